"""Streamed tokens joined into fewer page updates (:class:`TokenBatcher`).

Chainlit sends each ``stream_token`` call to the browser as one websocket event, and the page
renders the answer's whole markdown again for each. An engine streaming ~150 tokens/s (the
tiny model on CPU; a real one on a GPU streams at that order) then left the page seconds behind
the server, its Stop button too. Joined pieces at most every :data:`FLUSH_INTERVAL_S` keep the
page as current as a reader can follow.

No Chainlit import: unit-tested in the main test environment.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Seconds between two page updates of a streaming answer, at most 20 per second: a reader
#: sees the text flow (a display refreshes every ~17 ms; words come every 100-300 ms) and the
#: page renders ~7x less at 150 tokens/s.
FLUSH_INTERVAL_S = 0.05


class TokenBatcher:
    """Joins streamed token texts into pieces: :meth:`add` returns the joined text once
    ``interval_s`` seconds have passed since the last piece (the first token at once, so the
    TTFT the user sees is the server's), else None and keeps it; :meth:`rest` returns what is
    kept (call it when the stream ends, whatever ended it)."""

    def __init__(self, interval_s: float = FLUSH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._kept: list[str] = []
        self._last: float | None = None

    def add(self, text: str) -> str | None:
        """Keep ``text``; the joined piece when one is due, else None."""
        self._kept.append(text)
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            return None
        self._last = now
        return self.rest()

    def rest(self) -> str:
        """Everything kept, joined (empty when nothing is), and forget it."""
        piece = "".join(self._kept)
        self._kept.clear()
        return piece
