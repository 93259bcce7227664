"""The case's weights and their shards, as qgather.scenarios.data and FSDP2 make them (tests check both)."""

# ruff: noqa: F821 -- the script defines TP, TP_DIM, HSDP, SHARD_DIM, ... (see __init__)

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


def tp_piece(full: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's tensor-parallel piece: its rows (ColwiseParallel) or columns (RowwiseParallel)."""
    cut = shard_rows(full.shape[TP_DIM], TP, rank % TP)
    return full[cut] if TP_DIM == 0 else full[:, cut]


def local_part(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's part of a full tensor (master weight, gradient) as FSDP2 shards it over `size` ranks."""
    if TP:  # FSDP2 shards this rank's TP piece over "dp"
        full, size, rank = tp_piece(full, rank), size // TP, rank // TP
    if HSDP:  # every replica holds the whole weight, sharded over "shard"
        size, rank = size // HSDP, rank % (size // HSDP)
    if SHARD_DIM:
        return full[:, shard_rows(full.shape[1], size, rank)]
    return full[shard_rows(full.shape[0], size, rank)]


def masters(other: bool = False) -> dict[str, torch.Tensor]:
    """Each weight's float32 master (other: a decoy of other values, which a checkpoint load must overwrite)."""
    return {name: make_weight(shape, seed + 7919 * other, torch.float32) * scale * (1 + 3 * other)
            for name, (shape, seed, scale) in WEIGHTS.items()}
