"""Tiny case functions for the benchmark and smoke checks (module-level, so ranks can import them)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from qgather.runtime.rank import CaseContext


def trivial(ctx: CaseContext) -> list[int]:
    """The runtime's barrier, then a one-element all-gather: the least a real case does."""
    mine = torch.tensor([ctx.rank], device=ctx.device)
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, group=ctx.group)
    return [int(t) for t in gathered]


def collectives_only(ctx: CaseContext, iterations: int) -> float:
    """Seconds per (barrier-equivalent + one-element all-gather), timed inside the rank."""
    token = torch.zeros(1, device=ctx.device)
    mine = torch.tensor([ctx.rank], device=ctx.device)
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(token, group=ctx.group)
        dist.all_gather(gathered, mine, group=ctx.group)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations


def crash_rank(ctx: CaseContext, rank: int = 1) -> None:
    """Rank `rank` dies with exit code 3 while the others wait in a barrier."""
    if ctx.rank == rank:
        os._exit(3)
    dist.barrier()
