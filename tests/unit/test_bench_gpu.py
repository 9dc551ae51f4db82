"""``bench/gpu.sh``'s run (issue 31 point 11), the parts that need no GPU: the script calls
options ``bench.compare`` has, the fourth arm and the photos cell enter every block's balanced
plan, and ``bench.verdict`` prints the GPU targets exactly when the ledger has the raw4 arm."""

from __future__ import annotations

import random
import re
import shlex
from collections import Counter
from itertools import permutations
from pathlib import Path

import pytest

from bench import compare, verdict

ROOT = Path(__file__).resolve().parents[2]
GPU_ARMS = (*compare.ARMS, "raw4")


def gpu_sh_compare_args() -> list[str]:
    """The arguments bench/gpu.sh passes to ``python -m bench.compare``, its variables
    given their defaults."""
    text = (ROOT / "bench" / "gpu.sh").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if "-m bench.compare" in ln]
    line = line.split("-m bench.compare", 1)[1]
    line = line.replace("${BLOCKS:-2}", "2").replace("$OUT", "out")
    return shlex.split(line)


def test_gpu_sh_runs_the_blocked_design_with_the_raw4_arm_and_the_photos_cell():
    args = compare.parse_args(gpu_sh_compare_args())
    assert args.extra_arm == ["raw4"] and args.photo_throughput == 16
    assert args.blocks == 2 and args.no_extend  # the ~8 minute budget
    # Its own ledger and table: never pooled with the CPU history.
    assert args.ledger == Path("out/ledger.jsonl") and args.md == Path("out/bench.md")
    with pytest.raises(SystemExit):
        compare.parse_args(["--extra-arm", "raw9"])


def test_the_fourth_arm_and_the_photos_cell_are_in_every_block_balanced():
    run = compare.Run("r", "c", False, Path("l"), 0, GPU_ARMS, 16)
    assert run.cells == (*compare.GATED, compare.PHOTOS_CELL)
    assert compare.Run("r", "c", False, Path("l"), 0).cells == tuple(compare.GATED)
    plan = compare.block_plan(0, range(24), run.arms, run.cells)
    for _, cells in plan:
        assert sorted(c for c, _ in cells) == sorted(run.cells)
        assert all(sorted(order) == sorted(GPU_ARMS) for _, order in cells)
    for cell in run.cells:
        assert Counter(dict(cells)[cell] for _, cells in plan) == {
            p: 1 for p in permutations(GPU_ARMS)}
    # The CPU run's plan is what it was (defaults: three arms, the gated cells).
    assert compare.block_plan(0, range(12)) == compare.block_plan(
        0, range(12), compare.ARMS, tuple(compare.GATED))
    seeds = [s for b in range(4) for s in compare.photos_cell_seeds(0, b, 16)]
    assert len(set(seeds)) == len(seeds) == 4 * 32
    assert not set(seeds) & {s for b in range(4) for s in compare.photo_seeds(0, b)}


def gpu_ledger(photo_vs_raw: float, photo_vs_raw4: float, arms=GPU_ARMS, blocks: int = 4):
    """Synthetic segments: ours' photos rps at the given ratios, image16 at 10 rps, text64 at
    13000 tok/s, 2 % noise."""
    rng = random.Random(0)
    out = []
    for b in range(blocks):
        for arm in arms:
            photos = 6.0 * {"ours": photo_vs_raw, "raw4": photo_vs_raw / photo_vs_raw4}.get(
                arm, 1.0)
            cells = {"photos": {"rps": photos}, "image16": {"rps": 10.0},
                     "text64": {"tok_s": 13000.0, "rps": 200.0}}
            for cell, metrics in cells.items():
                noisy = {k: v * (1 + 0.02 * rng.gauss(0, 1)) for k, v in metrics.items()}
                out.append({"schema": 1, "run": "g1", "commit": "c", "dirty": False,
                            "half": 0, "block": b, "cell": cell, "arm": arm, "position": 0,
                            "rerun": 0, "flagged": False, "metrics": noisy, "machine": {}})
    return out


def test_the_gpu_targets_are_reported_when_the_raw4_arm_ran():
    lines = verdict.gpu_lines(gpu_ledger(2.0, 1.3))
    names = [re.match(r"gpu target (\w+): ", ln).group(1) for ln in lines]
    assert names == ["gpu_photo_rps", "gpu_photo_rps_raw4", "gpu_image16_rps",
                     "gpu_text64_tok_s"]
    assert all(ln.endswith(": pass") for ln in lines), lines
    t = verdict.gpu_targets(gpu_ledger(2.0, 1.3))
    assert t["gpu_photo_rps"].estimate == pytest.approx(2.0, rel=0.05)
    assert t["gpu_photo_rps_raw4"].estimate == pytest.approx(1.3, rel=0.05)
    assert t["gpu_text64_tok_s"].estimate == pytest.approx(13000, rel=0.05)
    slow = verdict.gpu_targets(gpu_ledger(1.2, 0.9))
    assert slow["gpu_photo_rps"].verdict == slow["gpu_photo_rps_raw4"].verdict == "fail"
    assert verdict.gpu_lines(gpu_ledger(2.0, 1.3, arms=compare.ARMS)) == []
