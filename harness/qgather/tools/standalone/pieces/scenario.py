"""The scenario a script runs over a route's `sharded`, `read` and `requantize` (pieces.routes,
pieces.reference): `gathered_once` (gather: FSDP2's first unshard) or `gathered_steps` (steps and
reshard: optimizer steps, each shard re-quantized, each re-gather judged), as qgather.scenarios.fsdp
runs them. Each returns this rank's (label, first global row, got, want) per unshard."""

# ruff: noqa: F821 -- the script defines CASE, SHAPE, ... and the other pieces' functions (see __init__)

from __future__ import annotations

import torch


def gathered_once(rank: int, device: torch.device) -> list[tuple]:
    """The gather scenario: FSDP2's first unshard of the sharded weight."""
    module, weight = sharded(rank, device)
    want = quantize(weight.to(DTYPE))
    module.unshard()
    return [("unshard 1", 0, read(module, want), want)]


def gathered_steps(rank: int, device: torch.device) -> list[tuple]:
    """unshard 1 (REQUANTIZE_FIRST: after each shard was re-quantized from its own, unchanged rows, an
    optimizer step before the first all-gather), then STEPS SGD steps on this rank's rows and, for the
    golden, on the whole weight, each shard re-quantized from its new rows and re-gathered."""
    module, master = sharded(rank, device)
    rows = shard_rows(SHAPE[0], WORLD_SIZE, rank)
    mine, full = torch.nn.Parameter(master[rows].clone()), torch.nn.Parameter(master.clone())
    optimizer, stages = torch.optim.SGD([mine, full], lr=0.05, momentum=0.9), []  # elementwise: per tensor
    for step in range(STEPS + 1):
        if step:
            grad = make_weight(SHAPE, SEED * 1000 + step, torch.float32)
            mine.grad, full.grad = grad[rows].clone(), grad
            optimizer.step()
        if step or REQUANTIZE_FIRST:
            with torch.no_grad():
                requantize(module, mine.detach().to(device, DTYPE))
        want = quantize(full.detach().to(DTYPE))
        module.unshard()
        got = {name: t.detach().cpu().clone() for name, t in read(module, want).items()}  # reshard frees them
        stages.append((f"unshard {step + 1}" + (f" (after step {step})" if step else ""), 0, got, want))
        module.reshard()
    return stages
