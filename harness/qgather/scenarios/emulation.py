"""FSDP2's sharding and hook-calling conventions, emulated where the harness calls the hooks itself
(the hooks and virtual scenarios): the dim-0 chunking, a rank's padded local shard, the pre-hook's
call signature and FSDP2's padded-size rule for uneven shards; and, for tensor parallelism, a TP
style's split of the full parameter before FSDP2 shards each piece.

Each piece follows torch 2.13's FSDPParam (`_init_sharded_param`, `all_gather_inputs`), so that a
subclass sees the same calls here as under `fully_shard`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from inspect import signature
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from qgather.errors import HarnessFault
from qgather.model.case import ShardLayout

#: the metadata of a shard FSDP2 gathers as it is (a plain tensor: no hooks run)
PLAIN = "plain tensor: no hooks"


class VirtualMesh:
    """What the hooks read from a mesh: its size. Used where no real DeviceMesh exists."""

    def __init__(self, world_size: int) -> None:
        self._size = world_size

    def size(self, dim: int | None = None) -> int:
        """The mesh's size (one dimension: `dim` is ignored)."""
        return self._size


class PaddedSizeRule(HarnessFault):
    """FSDP2's rule for uneven shards, checked by the harness where it calls the hooks itself. It is
    raised only on ranks with padding, as FSDP2 raises it; never an implementation's rejection."""


def tensor_parallel_pieces(param: torch.Tensor, tp_size: int, dim: int) -> list[torch.Tensor]:
    """A TP style's split of the full parameter on the "tp" mesh dimension, as DTensor's Shard(dim)
    makes it for a rank that splits its own copy (`src_data_rank=None`): torch.chunk along `dim`,
    each rank's piece cloned (torch 2.13's Shard._select_split_tensor)."""
    return [piece.clone() for piece in torch.chunk(param, tp_size, dim=dim)]


def fsdp2_chunks(param: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """FSDP2's dim-0 split of a parameter: torch.chunk, padded with new_empty(0) placeholders."""
    chunks = list(torch.chunk(param, world_size, dim=0))
    while len(chunks) < world_size:
        chunks.append(chunks[0].new_empty(0))
    return chunks


def shard_like_fsdp2(param: torch.Tensor, piece: torch.Tensor, shards: ShardLayout) -> torch.Tensor:
    """A rank's local shard, built through the same subclass ops FSDP2's FSDPParam uses on its
    chunk: new_zeros to the padded size, narrow + copy_, narrow."""
    padded = param.new_zeros((shards.chunk, *param.shape[1:]))
    length = piece.size(0) if piece.numel() > 0 else 0
    if length:
        padded.narrow(0, 0, length).copy_(piece)
    return padded.narrow(0, 0, length)


def check_padded_inputs(local: torch.Tensor, inputs: Sequence[torch.Tensor], shards: ShardLayout,
                        full_shape: Sequence[int]) -> None:
    """FSDP2's own rule for uneven shards, applied where the harness calls the hooks itself."""
    padded = torch.Size((shards.chunk, *full_shape[1:]))
    if local.size() != padded and any(t.size() != padded for t in inputs):
        raise PaddedSizeRule(
            f"When a parameter is unevenly sharded by FSDP (orig size={tuple(full_shape)}, FSDP world size="
            f"{shards.world_size}), fsdp_pre_all_gather must return all-gather inputs with the padded "
            f"sharded size {tuple(padded)} but got {[tuple(t.size()) for t in inputs]}"
        )


def pre_all_gather(local: torch.Tensor, mesh: Any, full_shape: Sequence[int]) -> tuple[Sequence[torch.Tensor], Any]:
    """Call the pre-hook as FSDP2 does: the one-argument (mesh) form is still accepted there."""
    hook = local.fsdp_pre_all_gather
    if _mesh_only(getattr(hook, "__func__", hook), hasattr(hook, "__func__")):
        return hook(mesh)
    stride = torch.empty(0).new_empty(full_shape).stride()
    return local.fsdp_pre_all_gather(mesh, torch.Size(full_shape), stride, None, MixedPrecisionPolicy())


@cache
def _mesh_only(function: Callable[..., Any], bound: bool) -> bool:
    """Whether a pre-hook takes the mesh alone (its signature read once per hook, not once per rank)."""
    return len(signature(function).parameters) - bound == 1


def checked_pre_all_gather(local: torch.Tensor, mesh: Any, full_shape: Sequence[int],
                           shards: ShardLayout) -> tuple[Sequence[torch.Tensor], Any]:
    """(all-gather inputs, metadata) of one rank's shard, as FSDP2 would get them: the pre-hook's,
    checked against the padded-size rule; a shard that fell back to a plain tensor gathers its
    padded values and no hook runs (metadata PLAIN)."""
    if not hasattr(local, "fsdp_pre_all_gather"):
        padded = local.new_zeros((shards.chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        return (padded,), PLAIN
    inputs, metadata = pre_all_gather(local, mesh, full_shape)
    check_padded_inputs(local, inputs, shards, full_shape)
    return inputs, metadata
