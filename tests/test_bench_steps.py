"""`qgather bench gpu`'s step table over the ranks: a rank's wait for the last one before the
collective is split out of its collective, every step shows its slowest and fastest rank, and each
of qgather's own steps is held to 5x its HBM floor."""

import pytest

from qgather.tools.bench.bench_steps import (
    COLLECTIVE,
    FLOOR_GOAL,
    WAIT,
    WAIT_ON_LIBRARY,
    RankSteps,
    StepSpread,
    floor_misses,
    floor_seconds,
    library_seconds,
    median_slowest,
    split_waits,
    spreads,
    table_lines,
)


def _ranks():
    # rank 1 spends 0.08 s longer on its golden and reaches the collective 0.08 s after rank 0
    return [RankSteps(0, {"golden": 0.01, COLLECTIVE: 0.09}, {"golden": 10.0, COLLECTIVE: 10.01}),
            RankSteps(1, {"golden": 0.09, COLLECTIVE: 0.01}, {"golden": 10.0, COLLECTIVE: 10.09})]


def test_the_wait_for_the_last_rank_is_split_out_of_the_collective():
    split, last = split_waits(_ranks())
    assert last == 1
    assert split[0].seconds[WAIT] == pytest.approx(0.08) and split[0].seconds[COLLECTIVE] == pytest.approx(0.01)
    assert split[1].seconds[WAIT] == 0.0 and split[1].seconds[COLLECTIVE] == pytest.approx(0.01)
    table = {s.step: s for s in spreads(split)}
    assert (table[WAIT].slowest_rank, table[WAIT].fastest_rank) == (0, 1)
    assert (table["golden"].slowest_rank, table["golden"].slowest_s) == (1, 0.09)
    lines = "\n".join(table_lines(spreads(split), {}, last))
    assert "rank 1 reached the collective last" in lines and "(r0)" in lines


def test_the_part_of_a_wait_the_last_rank_spent_in_the_librarys_steps_is_the_librarys():
    """Rank 1 arrives 0.10 s late: 0.07 s longer in its sharded module build, 0.01 s in FSDP2's unshard,
    0.02 s in qgather's build/quantize. Rank 0's wait is 0.08 s on the library, 0.02 s on qgather."""
    ranks = [RankSteps(0, {"build/quantize": 0.01, "sharded module": 0.10, "shard": 0.02, COLLECTIVE: 0.11},
                       {COLLECTIVE: 10.0}),
             RankSteps(1, {"build/quantize": 0.03, "sharded module": 0.17, "shard": 0.03, COLLECTIVE: 0.01},
                       {COLLECTIVE: 10.1})]
    split, last = split_waits(ranks)
    assert last == 1
    assert split[0].seconds[WAIT_ON_LIBRARY] == pytest.approx(0.08) and split[0].seconds[WAIT] == pytest.approx(0.02)
    assert split[0].seconds[COLLECTIVE] == pytest.approx(0.01)
    assert split[1].seconds[WAIT_ON_LIBRARY] == split[1].seconds[WAIT] == 0.0
    floors = floor_seconds({COLLECTIVE: 100}, bandwidth=1e6)  # the wait held to 5 x 0.1 ms
    assert [step for step, _, _ in floor_misses(spreads(split), floors)] == [WAIT]  # the library's part is no goal
    faster_library = [RankSteps(0, {**ranks[0].seconds, "sharded module": 0.30}, ranks[0].started), ranks[1]]
    split, _ = split_waits(faster_library)  # the late rank was quicker in the library: all of it is qgather's
    assert split[0].seconds[WAIT_ON_LIBRARY] == 0.0 and split[0].seconds[WAIT] == pytest.approx(0.1)
    lines = "\n".join(table_lines(spreads(split), {}, 1))
    assert WAIT_ON_LIBRARY in lines and "sharded module, shard, pre-all-gather hook" in lines


def test_the_librarys_own_steps_alone_are_summed_per_rank_and_the_largest_taken():
    """fp8_block's median run on 2 x H200 (2026-11-29): rank 1's library steps alone, 9.29 ms, are more
    than 3x the bare work's 3.04 ms; qgather's own (build/quantize, inspection, the wait on qgather)
    are left out, the wait on the library's steps is in."""
    ms = 1e-3
    ranks = [RankSteps(0, {"sharded module": 2.88 * ms, "shard": 1.25 * ms, COLLECTIVE: 2.59 * ms,
                           "post-all-gather hook": 0.11 * ms, "library forward": 1.81 * ms, "reshard": 0.08 * ms,
                           WAIT_ON_LIBRARY: 0.16 * ms, WAIT: 0.05 * ms, "inspection": 4.13 * ms,
                           "build/quantize": 1.95 * ms}, {}),
             RankSteps(1, {"sharded module": 3.17 * ms, "shard": 1.25 * ms, COLLECTIVE: 2.53 * ms,
                           "post-all-gather hook": 0.11 * ms, "library forward": 2.13 * ms, "reshard": 0.10 * ms,
                           "inspection": 4.60 * ms, "build/quantize": 1.84 * ms}, {})]
    seconds, rank = library_seconds(ranks)
    assert rank == 1 and seconds == pytest.approx(9.29 * ms)
    assert library_seconds(ranks[:1]) == (pytest.approx(8.88 * ms), 0)


def test_a_wait_never_exceeds_the_collective_and_a_rank_without_one_leaves_the_table_as_it_was():
    skewed = [RankSteps(0, {COLLECTIVE: 0.01}, {COLLECTIVE: 0.0}), RankSteps(1, {COLLECTIVE: 0.01}, {COLLECTIVE: 5.0})]
    assert split_waits(skewed)[0][0].seconds[WAIT] == 0.01  # clocks apart: at most the whole collective
    failed = [RankSteps(0, {"golden": 1.0}, {"golden": 0.0}), RankSteps(1, {COLLECTIVE: 1.0}, {COLLECTIVE: 1.0})]
    assert split_waits(failed) == (failed, None)


def test_only_qgathers_own_steps_are_held_to_their_floor():
    floors = floor_seconds({"golden": 1000, COLLECTIVE: 100, "sharded module": 100}, bandwidth=1e6)
    assert floors[WAIT] == floors[COLLECTIVE] == 1e-4  # the wait is held to the collective's floor
    split, _ = split_waits(_ranks())
    misses = floor_misses(spreads(split), floors)
    # golden: 0.09 s vs 5 x 1 ms; the wait: 0.08 s vs 5 x 0.1 ms; the collective is the library's
    assert sorted(step for step, _, _ in misses) == ["golden", WAIT]
    slow_library = [RankSteps(0, {"sharded module": 1.0}, {})]
    assert floor_misses(spreads(slow_library), floors) == []
    within = [RankSteps(0, {"golden": FLOOR_GOAL * 1e-3}, {})]
    assert floor_misses(spreads(within), floors) == []


def test_the_floor_goals_judge_each_step_by_its_median_run_not_one_runs_stall():
    """inspection stalled in one run of three (nvfp4_2d on 2 x H200: 6.4x its floor in one bench, 4.0-4.7x
    in the others): the median of the three is judged; a step one run lacks counts 0 s there."""
    runs = [[StepSpread("inspection", 0.004, 1, 0.003, 0), StepSpread("golden", 0.001, 0, 0.001, 1)],
            [StepSpread("inspection", 0.010, 0, 0.004, 1)],
            [StepSpread("inspection", 0.0045, 0, 0.004, 1), StepSpread("golden", 0.002, 1, 0.001, 0)]]
    judged = {s.step: s for s in median_slowest(runs)}
    assert judged["inspection"] == runs[2][0] and judged["golden"] == runs[0][1]
    floors = {"inspection": 0.001, "golden": 0.001}
    assert floor_misses(list(judged.values()), floors) == []
    assert floor_misses(runs[1], floors) == [("inspection", 0.010, 0.001)]
