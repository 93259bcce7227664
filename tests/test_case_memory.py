"""What a case holds on a rank while it inspects the gathered weight: a gather case lets go of the
full weight once the sharded module exists (on a GPU rank the weight's full copy would sit next to
the gathered one; `qgather bench gpu --profile` shows the step peaks)."""

from __future__ import annotations

import pytest


def weight_alive_at_inspection(ctx, case_id: str) -> list[bool]:
    """On a pool rank: run the case and say, at each inspection, whether the full weight the case
    drew is still alive (after a collection)."""
    import gc
    import weakref

    from qgather.check.inspection import Inspector
    from qgather.model.case import CaseSpec
    from qgather.scenarios import fsdp
    from qgather.scenarios.registry import run_on_rank

    refs, alive = [], []
    make_weight, judge = fsdp.make_weight, Inspector.judge

    def recording_make_weight(*args, **kwargs):
        weight = make_weight(*args, **kwargs)
        refs.append(weakref.ref(weight))
        return weight

    def checking_judge(*args, **kwargs):
        gc.collect()
        alive.append(any(ref() is not None for ref in refs))
        return judge(*args, **kwargs)

    fsdp.make_weight, Inspector.judge = recording_make_weight, checking_judge
    try:
        run_on_rank(ctx, CaseSpec.parse(case_id))
    finally:
        fsdp.make_weight, Inspector.judge = make_weight, judge
    return alive


@pytest.mark.parametrize("scenario,kept", [("gather", False), ("steps", True)])
def test_a_gather_case_lets_go_of_its_full_weight(scenario, kept):
    """A large weight's full copy would sit next to the gathered one on a GPU rank: a gather case
    holds only its shard once the module exists (a steps case keeps the masters it steps)."""
    from qgather.runtime import PoolSpec, get_pool

    case_id = f"reference:fp8_tensor:128x64:bf16:ws2:{scenario}:s0"
    outcome = get_pool(PoolSpec("gloo", 2, "cpu")).run(weight_alive_at_inspection, case_id, timeout=120)
    assert outcome.status == "ok", outcome.summary()
    assert all(alive == [kept] * len(alive) and alive for alive in outcome.results), outcome.results


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # a reference cycle, as FSDP2's hooks make: only the cyclic collector frees it


def test_a_gpu_rank_collects_each_cases_cycles_and_in_time_the_frozen_ones():
    """A GPU rank collects after each case but freezes the survivors (a full walk costs ~0.3 s a case):
    a case's own cycle goes at once, and one that lived through a freeze goes within the full
    collection's period."""
    import gc
    import weakref

    import torch

    from qgather.runtime import rank

    state = rank._RankState(config=None, device=torch.device("cuda", 0), group=None)
    try:
        fresh = _Cycle()
        fresh_ref = weakref.ref(fresh)
        del fresh
        rank._release_device_memory(state)
        assert fresh_ref() is None, "a case's cycle outlived the collection after it"

        survivor = _Cycle()
        survivor_ref = weakref.ref(survivor)
        rank._release_device_memory(state)  # survives: frozen
        del survivor
        cases = 0
        while survivor_ref() is not None and cases <= rank.FULL_COLLECTION_EVERY:
            rank._release_device_memory(state)
            cases += 1
        assert survivor_ref() is None, f"a frozen cycle was still alive {cases} cases later"
        assert cases > 1, "the first collection freed the cycle: nothing had been frozen"
    finally:
        gc.unfreeze()
