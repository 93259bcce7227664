"""The case's master weight and its shards, as qgather.scenarios.data and FSDP2 make them (tests check both)."""

from __future__ import annotations

import torch


def make_weight(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """randn(shape) from the seed, rows scaled from 2^-6 to 2^6 (shards get very different amaxes)."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (values * torch.exp2(torch.linspace(-6.0, 6.0, shape[0])).reshape(-1, *[1] * (len(shape) - 1))).to(dtype)


def shard_rows(rows: int, world_size: int, rank: int) -> slice:
    """The rows FSDP2 gives `rank`: torch.chunk, ceil(rows / world_size) per rank."""
    chunk = -(-rows // world_size)
    return slice(min(rank * chunk, rows), min((rank + 1) * chunk, rows))
