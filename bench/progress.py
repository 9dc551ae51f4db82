"""Progress of the long benchmarks: a tqdm bar on stderr, what is done of how much and an ETA.

stdout stays what the benchmarks print for people and for parsers (tables, one line per block
or episode, the verdict or summary line last); the bars go to stderr, so ``... | tail -1`` and
the tests read stdout as before. :func:`say` prints a line to stdout without tearing a bar
drawn on the same terminal (it clears the bars, prints, draws them again).

Not for ``python -m bench.layers --marks``: that process is counted under cachegrind and
lists the modules it loaded (:mod:`bench.layers_gate`), so it must not import tqdm.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: float, desc: str, unit: str, **kwargs) -> tqdm:
    """A progress bar on stderr: ``desc: 40%|████      | 24/60 unit [02:10<03:15, ...]``.

    ``total`` may grow while it runs (``bar.total += n``, then ``bar.refresh()``), as when a
    run adds blocks or runs a segment again. tqdm's defaults otherwise (drawn whether or not
    stderr is a terminal; a log file gets one line per update, ``\\r``-separated).
    """
    kwargs.setdefault("smoothing", 0.1)  # the ETA from the mean over many steps: they vary
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                **kwargs)


def say(*args, **kwargs) -> None:
    """``print(*args, flush=True)`` to stdout, clearing the bars first and drawing them again
    after (the same text on stdout as a plain ``print``)."""
    with tqdm.external_write_mode(file=sys.stdout):
        print(*args, flush=True, **kwargs)
