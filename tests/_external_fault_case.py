"""Run on each rank by test_external_faults.py (two srun-like tasks): one rank raises, then one dies.

Both tests fail on every rank (the same outcome everywhere); after the death the job is unusable,
so the session stops before the last test.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from qgather.runtime import PoolSpec, get_pool

SPEC = PoolSpec("gloo", 2, "cpu")
CASE_TIMEOUT_S = 4.0  # the watchdog needs WAIT_EVIDENCE_S (1 s) of it to see rank 0 waiting


def rank1_raises(ctx):
    if ctx.rank == 1:
        raise RuntimeError("injected fault on rank 1")
    dist.barrier(group=ctx.group)  # rank 0 waits here for a rank that will never come
    return ctx.rank


def rank1_dies(ctx):
    if ctx.rank == 1:
        os._exit(17)
    dist.barrier(group=ctx.group)
    return ctx.rank


def test_a_rank_raises():
    outcome = get_pool(SPEC).run(rank1_raises, case_id="fault:raise", timeout=CASE_TIMEOUT_S)
    assert outcome.ok, "QGATHER_FAULT " + outcome.summary()


def test_a_rank_dies():
    outcome = get_pool(SPEC).run(rank1_dies, case_id="fault:die", timeout=CASE_TIMEOUT_S)
    assert outcome.ok, "QGATHER_FAULT " + outcome.summary()


def test_not_reached_after_the_job_lost_a_rank():
    pass
