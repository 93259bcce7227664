"""Held collectives (qgather.runtime.agreement): a rank that raised releases the ranks waiting for it.

Real ranks on gloo. The pool's pids tell whether it stayed warm: with holds, a rank that raised before
a collective of its group (every rank, or some: a pair, a dimension of a 2-D mesh) costs no new pool;
without them (the CPU's default) it does, and a wait the hold cannot cover (for a rank that died) is
ended as before.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
import torch.distributed as dist

from qgather.engine.classify import classify_outcome
from qgather.model.verdict import Verdict
from qgather.runtime import PoolSpec, RankPool
from qgather.runtime.agreement import Agreement
from qgather.runtime.held_collectives import HOLD_WAITS, NATIVE
from qgather.runtime.protocol import HeldWait
from qgather.runtime.replies import Replies
from qgather.runtime.restart import RESTART_PHASE, RESTART_WAIT, START_PHASE, START_WAIT

SPEC = PoolSpec("gloo", 3, "cpu")
SPEC4 = PoolSpec("gloo", 4, "cpu")
CASE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def held():
    pool = RankPool(SPEC, hold_collectives=True)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def held4():
    pool = RankPool(SPEC4, hold_collectives=True)
    yield pool
    pool.shutdown()


def warm(pool):
    """The pool's pids, once it has run a case (a held test's pool may be fresh)."""
    if not pool.pids:
        assert pool.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"
    return pool.pids


def everyone(ctx):
    """Nested (all_gather_object gathers through all_gather) and async collectives, all held."""
    objects = [None] * ctx.world_size
    dist.all_gather_object(objects, ctx.rank)
    mine = torch.tensor([ctx.rank])
    gathered = torch.zeros(ctx.world_size, dtype=mine.dtype)
    dist.all_gather_into_tensor(gathered, mine, async_op=True).wait()
    return objects, gathered.tolist()


def last_rank_raises_before_an_all_reduce(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError("block size 16 does not divide 136")
    dist.all_reduce(torch.ones(1))


def rank1_raises_before_a_pair_all_reduce(ctx):
    pair = dist.new_group([0, 1])  # every rank makes it; only ranks 0 and 1 reduce over it
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1), group=pair)


def rank1_dies_before_an_all_reduce(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def rank1_dies_before_a_pair_all_reduce(ctx):
    pair = dist.new_group([0, 1])
    if ctx.rank == 1:
        os._exit(3)
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1), group=pair)


def test_the_parent_knows_the_held_waits_by_their_function_names():
    assert (Agreement._wait_for_every_rank.__name__, Agreement._wait_for_members.__name__) == HOLD_WAITS


def test_held_collectives_give_the_same_results(held):
    out = held.run(everyone, timeout=CASE_TIMEOUT_S)
    assert out.status == "ok", out.summary()
    assert out.results == [([0, 1, 2], [0, 1, 2])] * 3


def test_a_rank_that_raised_releases_the_others_and_the_pool_stays_warm(held):
    pids = warm(held)
    out = held.run(last_rank_raises_before_an_all_reduce, timeout=CASE_TIMEOUT_S)
    assert out.status == "error"
    assert list(out.errors) == [2] and out.errors[2].message == "block size 16 does not divide 136"
    assert out.unfinished == (0, 1) and out.held_back == {0: "all_reduce", 1: "all_reduce"}
    assert out.summary() == ("rank 2 raised ValueError: block size 16 does not divide 136 "
                             "(ranks 0,1 were held before a collective (all_reduce))")
    assert "held there by qgather" in out.notes[0]["main thread at"]
    found = classify_outcome(out, SPEC.world_size)
    assert found.verdict is Verdict.ERROR
    assert ("ranks 0,1 did not raise: held before all_reduce, which the failed rank would never join, they left "
            "the case") in found.details
    assert not any("would wait" in line for line in found.details)
    assert held.pids == pids  # no rank was killed
    assert held.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"
    assert held.pids == pids


def test_without_holds_the_same_failure_costs_the_pool():
    pool = RankPool(SPEC, hold_collectives=False)
    try:
        pool.start()
        pids = pool.pids
        out = pool.run(last_rank_raises_before_an_all_reduce, timeout=CASE_TIMEOUT_S)
        assert out.status == "error" and out.unfinished == (0, 1) and not out.held_back
        assert "ranks 0,1 were waiting in a collective (all_reduce)" in out.summary()
        assert pool.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"
        assert set(pool.pids).isdisjoint(pids)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("case", [rank1_dies_before_an_all_reduce, rank1_dies_before_a_pair_all_reduce])
def test_a_rank_that_died_leaves_the_others_waiting_as_before(held, case):
    pids = warm(held)
    out = held.run(case, timeout=CASE_TIMEOUT_S)
    assert out.status == "crash", out.summary()
    assert not out.held_back
    assert held.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"
    assert set(held.pids).isdisjoint(pids)  # the ranks left waiting were replaced


def rank0_skips_the_barrier(ctx):
    if ctx.rank != 0:
        dist.barrier()
    return ctx.rank


def test_a_hang_at_the_hold_names_the_collective_the_ranks_wait_to_enter(held):
    """Nobody failed, so nobody releases: a HANG, and its evidence names the barrier, not the hold's own all-reduce."""
    held.pids or held.run(everyone, timeout=CASE_TIMEOUT_S)
    out = held.run(rank0_skips_the_barrier, timeout=2.0)
    found = classify_outcome(out, SPEC.world_size)
    assert found.verdict is Verdict.HANG, found.reason
    assert found.reason.endswith("ranks 1,2 were waiting at qgather's hold before a collective (barrier)"), found.reason
    held_at = "qgather's hold before barrier, waiting for every rank of its group to reach it"
    assert out.notes[1]["main thread at"] == held_at
    assert held.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"


def test_a_rank_that_raised_releases_its_partner_in_a_pair_and_the_pool_stays_warm(held):
    """Rank 2 takes no part in the pair's collective: only the pair's members hold it."""
    pids = warm(held)
    out = held.run(rank1_raises_before_a_pair_all_reduce, timeout=CASE_TIMEOUT_S)
    assert out.status == "error" and list(out.errors) == [1], out.summary()
    assert out.held_back == {0: "all_reduce"} and out.unfinished == (0,)
    assert out.results[2] is None  # returned
    assert "held there by qgather" in out.notes[0]["main thread at"]
    assert held.pids == pids  # no rank was killed
    assert held.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"


def pair_of_ranks_0_1_reduces(ctx):
    """Ranks 0 and 1 all-reduce over their pair; rank 2 does nothing: no rank waits for it."""
    pair = dist.new_group([0, 1])
    if ctx.rank in (0, 1):
        summed = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(summed, group=pair)
        return summed.item()
    return None


def test_a_collective_of_some_ranks_that_the_others_never_call_is_no_hang(held):
    out = held.run(pair_of_ranks_0_1_reduces, timeout=CASE_TIMEOUT_S)
    assert out.status == "ok", out.summary()
    assert out.results == [3.0, 3.0, None]


def pair_reduces_thrice(ctx, raise_before=None):
    """Three all-reduces over one pair (made once, kept for the pool's later cases), and a world one;
    rank 1 raises before the `raise_before`-th of the pair's."""
    if "pair" not in ctx.kept:
        ctx.kept["pair"] = dist.new_group([0, 1])
    pair = ctx.kept["pair"]
    results = []
    for step in range(3):
        if ctx.rank == 1 and step == raise_before:
            raise ValueError(f"rank 1 refuses step {step}")
        if ctx.rank in (0, 1):
            value = torch.tensor([float(10 * step + ctx.rank)])
            dist.all_reduce(value, group=pair)
            results.append(value.item())
    dist.all_reduce(torch.ones(1))
    return results


def test_a_pairs_collectives_stay_in_step_within_a_case_and_across_cases(held):
    pids = warm(held)
    expected = [[1.0, 21.0, 41.0]] * 2 + [[]]
    assert held.run(pair_reduces_thrice, timeout=CASE_TIMEOUT_S).results == expected
    out = held.run(pair_reduces_thrice, 1, timeout=CASE_TIMEOUT_S)
    assert out.status == "error" and list(out.errors) == [1], out.summary()
    # rank 0 at the pair's second collective; rank 2 at the world's, which rank 1, released by rank 0's
    # HeldBack, can now join: waits that depend on each other end in turn
    assert out.held_back == {0: "all_reduce", 2: "all_reduce"}, out.summary()
    assert held.pids == pids
    assert held.run(pair_reduces_thrice, timeout=CASE_TIMEOUT_S).results == expected


def short_last_rank_all_gathers(ctx):
    """The last rank's shard is one row short and not padded (TE's blockwise uneven shards, torchao's)."""
    rows = 3 if ctx.rank == ctx.world_size - 1 else 4
    shard = torch.ones(rows, 2)
    gathered = torch.zeros(ctx.world_size * rows, 2)
    dist.all_gather_into_tensor(gathered, shard)


def test_unequal_sizes_are_stopped_on_every_rank_and_the_pool_stays_warm(held):
    pids = warm(held)
    out = held.run(short_last_rank_all_gathers, timeout=CASE_TIMEOUT_S)
    assert out.status == "error" and sorted(out.errors) == [0, 1, 2] and not out.unfinished
    assert {e.type_name for e in out.errors.values()} == {"UnequalCollectiveSizes"}
    assert ("the ranks handed all_gather_into_tensor different sizes (rank 0: 32 bytes, rank 1: 32 bytes, "
            "rank 2: 24 bytes)") in out.errors[0].message
    verdict = classify_outcome(out, SPEC.world_size)
    assert verdict.verdict is Verdict.ERROR  # the same error on every rank, and still no rejection
    assert held.pids == pids
    assert held.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"


def functional_max(ctx):
    """torch's functional all-reduce (as torchao reduces an amax), held as an op; its overloads, which
    compiled graphs call, stay reachable while the case runs."""
    from torch.distributed import _functional_collectives as funcol
    assert torch.ops._c10d_functional.all_reduce.default is not None
    return funcol.all_reduce(torch.tensor([float(ctx.rank)]), "max", ctx.group).tolist()


def last_rank_raises_before_a_functional_all_reduce(ctx):
    """torchao on a zero-row shard: the empty rank's amax raises before the others' reduction."""
    if ctx.rank == ctx.world_size - 1:
        raise RuntimeError("max(): Expected reduction dim to be specified for input.numel() == 0")
    return functional_max(ctx)


def test_a_functional_collective_is_held_and_gives_the_same_result(held):
    pids = warm(held)
    assert held.run(functional_max, timeout=CASE_TIMEOUT_S).results == [[2.0]] * 3
    out = held.run(last_rank_raises_before_a_functional_all_reduce, timeout=CASE_TIMEOUT_S)
    assert out.status == "error" and list(out.errors) == [2], out.summary()
    assert out.held_back == {0: "all_reduce (functional)", 1: "all_reduce (functional)"}
    assert held.pids == pids  # no rank was killed
    assert held.run(functional_max, timeout=CASE_TIMEOUT_S).results == [[2.0]] * 3


class StandInQuantizer:
    """TE's current-scaling quantizer as the hold sees it: with amax reduction, quantize_impl all-reduces
    the amax inside a call no torch.distributed frame shows (here the unheld all-reduce, one level down)."""

    def __init__(self, reduce_amax: bool, skips_reduction: bool = False) -> None:
        self.with_amax_reduction = reduce_amax
        self.amax_reduction_group = None
        self.skips_reduction = skips_reduction  # a defect the hold cannot foresee: skips it with rows

    def quantize_impl(self, tensor):
        if tensor.numel() == 0:  # as TE's native code on a zero-row rank: no amax, and no reduction
            return []
        amax = tensor.abs().max().reshape(1)
        if self.with_amax_reduction and not self.skips_reduction:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # inside the held call: not held again
        return amax


def install_stand_in(ctx):
    module_name, class_name, _ = NATIVE[0]
    sys.modules[module_name] = types.SimpleNamespace(**{class_name: StandInQuantizer})


def remove_stand_in(ctx):
    del sys.modules[NATIVE[0][0]]


def last_rank_raises_before_a_native_reduction(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise AssertionError("fsdp_pre_all_gather must return all-gather inputs with the padded sharded size")
    return StandInQuantizer(reduce_amax=True).quantize_impl(torch.full((2,), float(ctx.rank))).tolist()


def rank0_quantizes_alone_without_reduction(ctx):
    """No amax reduction, no collective: nothing to hold, even where one rank alone quantizes."""
    if ctx.rank == 0:
        return StandInQuantizer(reduce_amax=False).quantize_impl(torch.ones(2)).tolist()
    return None


def test_a_library_method_that_reduces_the_amax_natively_is_held():
    pool = RankPool(SPEC, hold_collectives=True)
    try:
        assert pool.run(install_stand_in, timeout=CASE_TIMEOUT_S).status == "ok"  # held from the next case on
        pids = pool.pids
        out = pool.run(last_rank_raises_before_a_native_reduction, timeout=CASE_TIMEOUT_S)
        assert out.status == "error" and list(out.errors) == [2], out.summary()
        assert out.held_back == {0: "Float8CurrentScalingQuantizer.quantize_impl",
                                 1: "Float8CurrentScalingQuantizer.quantize_impl"}
        out = pool.run(rank0_quantizes_alone_without_reduction, timeout=CASE_TIMEOUT_S)
        assert out.status == "ok" and out.results == [[1.0], None, None], out.summary()
        assert pool.pids == pids
        assert pool.run(remove_stand_in, timeout=CASE_TIMEOUT_S).status == "ok"
    finally:
        pool.shutdown()


def last_rank_skips_the_reduction_inside(ctx):
    """Every rank comes to the held quantizer call with rows; the last rank's skips the reduction inside it
    and goes on to the next collective, where it waits at the hold while the others wait inside."""
    StandInQuantizer(reduce_amax=True, skips_reduction=ctx.rank == ctx.world_size - 1).quantize_impl(torch.ones(2))
    dist.barrier()


def last_rank_has_no_rows(ctx):
    rows = 0 if ctx.rank == ctx.world_size - 1 else 2 + ctx.rank  # uneven rows: the quantizer's normal case
    return StandInQuantizer(reduce_amax=True).quantize_impl(torch.ones(rows))


def every_rank_has_rows_of_its_own(ctx):
    return StandInQuantizer(reduce_amax=True).quantize_impl(torch.full((1 + ctx.rank,), float(ctx.rank))).tolist()


def no_rank_has_rows(ctx):
    return StandInQuantizer(reduce_amax=True).quantize_impl(torch.ones(0))


def test_a_zero_row_rank_beside_ranks_with_rows_stops_every_rank_before_the_native_reduction():
    """TE's quantizers return before their amax all-reduce on an empty input: the ranks with rows would
    wait in it forever (a pool aborted). Held, every rank raises before it, and the pool stays warm."""
    pool = RankPool(SPEC, hold_collectives=True)
    try:
        assert pool.run(install_stand_in, timeout=CASE_TIMEOUT_S).status == "ok"
        pids = pool.pids
        out = pool.run(last_rank_has_no_rows, timeout=CASE_TIMEOUT_S)
        assert out.status == "error" and sorted(out.errors) == [0, 1, 2], out.summary()
        assert {error.type_name for error in out.errors.values()} == {"UnjoinedCollective"}
        found = classify_outcome(out, SPEC.world_size)
        assert found.verdict == Verdict.ERROR, found
        assert "rank 2 handed Float8CurrentScalingQuantizer.quantize_impl an empty input" in found.reason, found
        assert "which ranks 0,1 would enter and wait in forever" in found.reason, found
        assert pool.pids == pids  # nobody was left inside the reduction
        out = pool.run(every_rank_has_rows_of_its_own, timeout=CASE_TIMEOUT_S)  # uneven, none empty: held, run
        assert out.status == "ok" and out.results == [[2.0]] * 3, out.summary()
        assert pool.run(no_rank_has_rows, timeout=CASE_TIMEOUT_S).status == "ok"  # nobody reduces: no hang
        assert pool.pids == pids
        assert pool.run(remove_stand_in, timeout=CASE_TIMEOUT_S).status == "ok"
    finally:
        pool.shutdown()


def test_ranks_split_between_the_hold_and_the_collective_it_let_them_into_end_as_a_hang_early(monkeypatch):
    from qgather.runtime import stall

    monkeypatch.setattr(stall, "STALL_EVIDENCE_S", 1.0)  # the parent's evidence window: seconds, not the deadline
    pool = RankPool(SPEC, hold_collectives=True)
    try:
        assert pool.run(install_stand_in, timeout=CASE_TIMEOUT_S).status == "ok"
        out = pool.run(last_rank_skips_the_reduction_inside, timeout=CASE_TIMEOUT_S)
        assert out.status == "hang" and out.note == stall.SPLIT_NOTE, out.summary()
        assert out.duration_s < CASE_TIMEOUT_S / 2, out.summary()
        summary = classify_outcome(out, SPEC.world_size).reason
        assert "rank 2 was waiting at qgather's hold before a collective (barrier)" in summary, summary
    finally:
        pool.shutdown()


def test_a_started_pool_says_where_its_start_went():
    fresh = RankPool(PoolSpec("gloo", 2, "cpu"))
    try:
        out = fresh.run(everyone, timeout=CASE_TIMEOUT_S)
        phases = dict(out.startup_phases)
        assert {"forkserver", "spawn", "ranks starting", "rank: rank set-up", "rank: process group",
                "rank: first barrier"} <= phases.keys(), phases
        assert sum(phases[p] for p in ("forkserver", "spawn", "ranks starting")) <= out.startup_s
        assert fresh.run(everyone, timeout=CASE_TIMEOUT_S).startup_phases == ()  # warm: no start
    finally:
        fresh.shutdown()


def rank1_dies(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def test_a_pool_a_failed_case_emptied_starts_again_in_the_background():
    pool = RankPool(PoolSpec("gloo", 2, "cpu"), restart_in_background=True)
    try:
        assert pool.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"
        pids = pool.pids
        assert pool.run(rank1_dies, timeout=CASE_TIMEOUT_S).status == "crash"
        pool.restart.thread.join(CASE_TIMEOUT_S)  # the test's own bound; the runner never joins it
        assert pool.started and set(pool.pids).isdisjoint(pids)  # up again before any case asked
        out = pool.run(everyone, timeout=CASE_TIMEOUT_S)
        assert out.status == "ok" and out.startup_s == 0.0
    finally:
        pool.shutdown()


def test_a_case_that_waits_for_the_restart_counts_the_wait_as_its_pool_start():
    pool = RankPool(PoolSpec("gloo", 2, "cpu"), restart_in_background=True)
    try:
        pool.run(everyone, timeout=CASE_TIMEOUT_S)
        pool.run(rank1_dies, timeout=CASE_TIMEOUT_S)
        out = pool.run(everyone, timeout=CASE_TIMEOUT_S)  # at once: the restart is under way, or done
        assert out.status == "ok", out.summary()
        phases = dict(out.startup_phases)
        if out.startup_s:  # the restart's own phases beside the wait: what the wait was made of
            assert set(phases) == {RESTART_WAIT, *(RESTART_PHASE + phase for phase, _ in pool.start_phases)}, phases
            assert f"{RESTART_PHASE}spawn" in phases, phases
    finally:
        pool.shutdown()


def test_a_case_after_a_first_start_in_the_background_counts_its_wait_as_that_start():
    pool = RankPool(PoolSpec("gloo", 2, "cpu"), restart_in_background=True)
    try:
        pool.start_in_background()  # under way from here: the case below waits for it (or finds it done)
        out = pool.run(everyone, timeout=CASE_TIMEOUT_S)
        assert out.status == "ok", out.summary()
        phases = dict(out.startup_phases)
        assert set(phases) == {START_WAIT, *(START_PHASE + phase for phase, _ in pool.start_phases)}, phases
        assert out.startup_s == phases[START_WAIT] > 0
        assert pool.run(rank1_dies, timeout=CASE_TIMEOUT_S).status == "crash"
        out = pool.run(everyone, timeout=CASE_TIMEOUT_S)  # a restart, under its own names
        assert RESTART_WAIT in dict(out.startup_phases) or out.startup_s == 0.0, out.startup_phases
        assert START_WAIT not in dict(out.startup_phases)
    finally:
        pool.shutdown()


def test_a_shutdown_stops_a_restart_not_yet_begun():
    pool = RankPool(PoolSpec("gloo", 2, "cpu"), restart_in_background=True)
    pool.run(everyone, timeout=CASE_TIMEOUT_S)
    with pool.in_use:  # the restart cannot begin while this holds the pool
        pool.start_in_background()
        pool.shutdown()
    pool.restart.thread.join(CASE_TIMEOUT_S)
    assert not pool.started


def test_a_standby_pool_takes_the_next_case_while_the_failed_one_restarts(monkeypatch):
    """registry._standby_for: a pool restarted once gets a standby, started in the background while the
    pool is up; from then on the case after a failure runs on the warm standby at once while the emptied
    pool restarts, and the two change places."""
    import threading

    from qgather.runtime import registry

    monkeypatch.setattr(PoolSpec, "restarts_in_background", property(lambda self: True))
    monkeypatch.delenv(registry.STANDBY_ENV, raising=False)
    spec = PoolSpec("gloo", 2, "cpu")
    go = threading.Event()

    def start_when_told(pool):
        def start(case_id=""):
            go.wait(CASE_TIMEOUT_S)  # the restart stays under way until the test has looked
            return RankPool.start(pool, case_id)
        return start

    registry.shutdown_pools(keep_helpers=True)
    try:
        first = registry.get_pool(spec)
        assert first.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"
        assert registry.get_pool(spec) is first and spec not in registry._standby, "a standby before any restart"
        first.start = start_when_told(first)
        assert first.run(rank1_dies, timeout=CASE_TIMEOUT_S).status == "crash"
        assert registry.get_pool(spec) is first and spec not in registry._standby, \
            "no standby was up: the case waits for the restart, and none starts beside it"
        go.set()
        first.restart.thread.join(CASE_TIMEOUT_S)
        assert registry.get_pool(spec) is first  # restarted once, up: its standby starts now
        standby = registry._standby[spec]
        standby.restart.thread.join(CASE_TIMEOUT_S)
        assert first.started and standby.started

        go.clear()
        assert first.run(rank1_dies, timeout=CASE_TIMEOUT_S).status == "crash"
        now = registry.get_pool(spec)
        assert now is standby and registry._standby[spec] is first, "the warm standby did not take the case"
        out = now.run(everyone, timeout=CASE_TIMEOUT_S)
        assert out.status == "ok" and out.startup_s == 0.0, out.summary()
        go.set()
        first.restart.thread.join(CASE_TIMEOUT_S)
        assert first.started, "the emptied pool did not restart as the standby"

        first.shutdown()  # as the seat yielder stops an idle standby: it is not started again case after case
        spawned = first.spawn_count
        for _ in range(2):
            assert registry.get_pool(spec) is standby
        assert not first.started and first.spawn_count == spawned and not first.restart.under_way
    finally:
        go.set()
        registry.shutdown_pools(keep_helpers=True)


def keys_in_the_store(ctx):
    return dist.distributed_c10d._get_default_store().num_keys()


def test_the_keys_of_a_held_collective_are_removed_at_the_next_case(held):
    """Each member's key of each held collective over the pair: removed, or the store grows case by case."""
    assert held.run(pair_reduces_thrice, timeout=CASE_TIMEOUT_S).status == "ok"  # the pair made (and kept)
    before = held.run(keys_in_the_store, timeout=CASE_TIMEOUT_S).results
    for _ in range(3):
        assert held.run(pair_reduces_thrice, timeout=CASE_TIMEOUT_S).status == "ok"
    assert held.run(keys_in_the_store, timeout=CASE_TIMEOUT_S).results == before


def pairs_0_1_and_2_3_reduce(ctx):
    """Two disjoint pairs; ranks 1 and 3 raise before their pair's all-reduce."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    if ctx.rank in (1, 3):
        raise ValueError(f"rank {ctx.rank} refuses")
    dist.all_reduce(torch.ones(1), group=pairs[ctx.rank // 2])


def test_only_a_wait_that_only_answered_ranks_can_end_is_released():
    """Replies.releasable, the runner's one rule: every member of the wait's group answered or waits there."""
    pair, other_pair, everyone4 = HeldWait((0, 1), 0), HeldWait((2, 3), 4), HeldWait((0, 1, 2, 3), 1)
    replies = Replies(4)
    replies.pending = {0, 2, 3}
    replies.held = {0: pair, 2: other_pair, 3: other_pair}
    assert replies.releasable() == [pair]  # {2,3}: both there, it ends by itself
    replies.held = {0: pair, 2: everyone4, 3: everyone4}
    assert replies.releasable() == [pair]  # every rank's wait: rank 0 is at another wait
    replies.pending = {2, 3}
    replies.held = {2: everyone4, 3: everyone4}
    assert replies.releasable() == [everyone4]  # once rank 0 left its case, in turn
    replies.released.add(everyone4)
    assert replies.releasable() == []  # each once
    replies.pending, replies.held = {0, 2}, {0: pair}
    assert replies.releasable() == [pair]  # rank 2 is elsewhere, but no member of rank 0's pair


def test_two_pairs_each_with_a_failed_rank_are_both_released(held4):
    pids = warm(held4)
    out = held4.run(pairs_0_1_and_2_3_reduce, timeout=CASE_TIMEOUT_S)
    assert out.status == "error" and sorted(out.errors) == [1, 3], out.summary()
    assert out.held_back == {0: "all_reduce", 2: "all_reduce"}
    assert held4.pids == pids
    assert held4.run(everyone, timeout=CASE_TIMEOUT_S).status == "ok"


def mesh_2x2(ctx):
    """A 2-D mesh (replicate x shard) as HSDP makes it: shard groups {0,1} and {2,3}; made once per pool."""
    from torch.distributed.device_mesh import init_device_mesh
    if "mesh 2x2" not in ctx.kept:
        ctx.kept["mesh 2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return ctx.kept["mesh 2x2"]


def rank3_raises_before_a_shard_amax(ctx):
    """torchao under HSDP: the amax all-reduced over the shard dimension (a functional collective)."""
    from torch.distributed import _functional_collectives as funcol
    mesh = mesh_2x2(ctx)
    if ctx.rank == 3:
        raise RuntimeError("max(): Expected reduction dim to be specified for input.numel() == 0")
    return funcol.all_reduce(torch.tensor([float(ctx.rank)]), "max", (mesh, 1)).tolist()


def test_a_functional_collective_over_a_mesh_dimension_is_held(held4):
    pids = warm(held4)
    out = held4.run(rank3_raises_before_a_shard_amax, timeout=CASE_TIMEOUT_S)
    assert out.status == "error" and list(out.errors) == [3], out.summary()
    assert out.held_back == {2: "all_reduce (functional)"}
    assert out.results[:2] == [[1.0], [1.0]]  # the other shard group's reduction went through
    assert held4.pids == pids


def short_rank1_all_gathers_over_a_pair(ctx):
    """Rank 1's shard is one row short on the pair {0,1}; rank 2 all-gathers nothing."""
    pair = dist.new_group([0, 1])
    if ctx.rank == 2:
        return None
    rows = 3 if ctx.rank == 1 else 4
    gathered = torch.zeros(2 * rows, 2)
    dist.all_gather_into_tensor(gathered, torch.ones(rows, 2), group=pair)
    return gathered.shape[0]


def test_unequal_sizes_on_a_pair_are_stopped_on_both_members(held):
    pids = warm(held)
    out = held.run(short_rank1_all_gathers_over_a_pair, timeout=CASE_TIMEOUT_S)
    assert out.status == "error" and sorted(out.errors) == [0, 1] and not out.unfinished, out.summary()
    assert {e.type_name for e in out.errors.values()} == {"UnequalCollectiveSizes"}
    assert ("the ranks handed all_gather_into_tensor different sizes (rank 0: 32 bytes, rank 1: 24 bytes)"
            in out.errors[1].message)
    assert held.pids == pids
