"""``make bench``'s design (``bench/compare.py``), the parts that need no server: the block
plan, the requests' seeds, the CPU accounting from ``/proc`` and the machine check that sends
a segment to be run again."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from itertools import permutations

import pytest

from bench import compare


def test_every_block_runs_every_gated_cell_once_with_every_arm_order_equally_often():
    plan = compare.block_plan(0, range(12))
    assert [block for block, _ in plan] == list(range(12))
    for _, cells in plan:
        assert sorted(cell for cell, _ in cells) == sorted(compare.GATED)
        assert all(sorted(order) == sorted(compare.ARMS) for _, order in cells)
    for cell in compare.GATED:
        orders = Counter(dict(cells)[cell] for _, cells in plan)
        # 12 blocks = two cycles of the 6 permutations: each exactly twice.
        assert orders == {p: 2 for p in permutations(compare.ARMS)}, (cell, orders)
    # The cells' order within a block varies between blocks, and the plan is reproducible.
    assert len({tuple(c for c, _ in cells) for _, cells in plan}) > 1
    assert compare.block_plan(0, range(12)) == plan
    assert compare.block_plan(1, range(12)) != plan


def test_a_later_range_of_blocks_continues_the_same_balanced_sequence():
    """An extension (blocks 9..12) takes the orders the whole sequence gives those blocks, so
    the blocks of a run stay balanced however far it extends."""
    whole = dict(compare.block_plan(0, range(13)))
    tail = dict(compare.block_plan(0, range(9, 13)))
    for block in range(9, 13):
        assert dict(tail[block]) == dict(whole[block])


def test_seeds_are_shared_by_the_arms_of_a_block_and_distinct_between_blocks_and_cells():
    seeds = {(block, cell): compare.cell_seed(0, block, cell)
             for block in range(20) for cell in compare.GATED}
    assert len(set(seeds.values())) == len(seeds)
    photos = [s for block in range(20) for s in compare.photo_seeds(0, block)]
    assert len(set(photos)) == len(photos) == 20 * (1 + compare.HISTORY_TURNS)
    assert compare.cell_seed(3, 2, "text16") == compare.cell_seed(3, 2, "text16")


def test_process_cpu_counts_a_busy_child_and_nothing_for_a_gone_process():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\n"
                              "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while compare.process_cpu_s(child.pid) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 0.4 <= compare.process_cpu_s(child.pid) < 5
    finally:
        child.kill()
        child.wait()
    assert compare.process_cpu_s(child.pid) == 0.0


def test_machine_cpu_moves_with_work_and_steal_is_a_share_of_total():
    busy0, steal0, total0 = compare.machine_cpu_s()
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    busy1, steal1, total1 = compare.machine_cpu_s()
    assert busy1 - busy0 >= 0.25
    assert total1 - total0 >= busy1 - busy0 - 0.02  # one clock tick of rounding
    assert 0 <= steal1 - steal0 <= total1 - total0 + 0.02


def test_a_segment_during_foreign_work_is_flagged_and_a_quiet_one_is_not():
    """The meter over a segment whose only arm is an idle process: a busy process that is
    neither an arm nor this client makes the foreign share exceed the bound, and the meter
    counts it as foreign, not as the arm's."""
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    class Arm:
        proc = idle

    arms = {"ours": Arm()}
    burner = None
    try:
        with compare.Meter(arms, "ours") as quiet:
            time.sleep(1.0)
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.3)
        with compare.Meter(arms, "ours") as busy:
            time.sleep(1.0)
    finally:
        for proc in (idle, burner):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert busy.foreign > compare.MAX_FOREIGN_CPU and busy.flagged, busy.foreign
    # One busy core of two is ~half the machine more than the quiet wait saw (which other
    # processes of a shared machine may also load a little).
    assert busy.foreign - quiet.foreign > 0.3, (quiet.foreign, busy.foreign)
    assert busy.api_s < 0.05 and busy.engine_s < 0.05


def test_arguments():
    args = compare.parse_args([])
    assert args.blocks == 9 and args.ledger == compare.DEFAULT_LEDGER
    with pytest.raises(SystemExit):
        compare.parse_args(["--blocks", "1"])
