"""Run on every rank by torchrun (see test_external_launcher.py): pytest per rank, one shared world.

Every rank gets the same CaseOutcome, so pytest decides the same thing everywhere; only the
reporting rank prints the line the launcher test looks for.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist

from qgather.runtime import ExternalPool, PoolSpec, PoolSpecError, external_world, get_pool, is_reporting_rank

WORLD_SIZE = 4
SPEC = PoolSpec("gloo", WORLD_SIZE, "cpu")


def gather_ranks(ctx):
    mine = torch.tensor([ctx.rank])
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, group=ctx.group)
    return [int(t) for t in gathered]


def fsdp2_shard_and_unshard(ctx):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(16, 8)
    reference = model.weight.detach().clone()
    fully_shard(model, mesh=ctx.mesh)
    local_rows = model.weight.to_local().shape[0]
    model.unshard()
    matches = bool(torch.equal(model.weight.detach(), reference))
    model.reshard()
    return {"local_rows": local_rows, "matches": matches}


def last_rank_rejects(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError("136 columns are not a multiple of 16")
    return ctx.rank


def overruns_its_timeout(ctx):
    threading.Event().wait(SLOW_CASE_S)  # no process to kill in-process: the case must end by itself
    return ctx.rank


SLOW_CASE_S, SLOW_TIMEOUT_S = 1.5, 0.3


def test_cases_run_in_the_launchers_world():
    world = external_world()
    assert world is not None and world[1] == WORLD_SIZE
    pool = get_pool(SPEC)
    assert isinstance(pool, ExternalPool)

    gathered = pool.run(gather_ranks, case_id="external:gather")
    assert gathered.status == "ok", gathered.summary()
    assert gathered.results == [list(range(WORLD_SIZE))] * WORLD_SIZE

    sharded = pool.run(fsdp2_shard_and_unshard, case_id="external:fsdp2", seed=1)
    assert sharded.status == "ok", sharded.summary()
    assert sharded.results == [{"local_rows": 2, "matches": True}] * WORLD_SIZE

    rejected = pool.run(last_rank_rejects, case_id="external:reject")
    assert rejected.status == "error" and list(rejected.errors) == [WORLD_SIZE - 1]
    assert rejected.results[:3] == [0, 1, 2]

    again = pool.run(gather_ranks, case_id="external:after-error")  # on a rebuilt group
    assert again.status == "ok", again.summary()

    slow = pool.run(overruns_its_timeout, case_id="external:slow", timeout=SLOW_TIMEOUT_S)
    assert slow.status == "hang" and sorted(slow.stacks) == list(range(WORLD_SIZE)), slow.summary()
    assert all("in overruns_its_timeout" in text for text in slow.stacks.values())
    assert pool.run(gather_ranks, case_id="external:after-hang").status == "ok"

    if is_reporting_rank():
        print("QGATHER_EXTERNAL_RESULT " + json.dumps({
            "gather": gathered.results[0], "fsdp2": sharded.results[0],
            "reject": rejected.summary(), "after_error": again.status, "slow": slow.summary(),
        }), flush=True)


def test_world_size_is_fixed_by_the_launcher():
    with pytest.raises(PoolSpecError, match=f"external launcher: world size is fixed at {WORLD_SIZE} by torchrun"):
        get_pool(PoolSpec("gloo", 8, "cpu"))
