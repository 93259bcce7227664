"""What the reference's all-gather puts on the wire: the layout every rank agrees on, and the byte
packing of row buffers into flat bytes and into FSDP2-shaped uint8 planes.

Wire modes (`WireMode`), chosen from shapes only, so identical on every rank:
- SINGLE (world size 1): one flat uint8 input holding every row buffer, because FSDP2's world-size-1
  path (torch 2.13) hands only the first all-gather input to fsdp_post_all_gather;
- ROWS (even shards: dim 0 divisible by the world size): each row buffer as it is, so the bytes moved
  equal the format's packed size;
- PLANES (uneven shards): FSDP2 requires every all-gather input to have the padded shard's shape, so
  the padded row buffers are serialized into uint8 planes of that shape and parsed back per rank;
  the per-tensor values (scale, amax) travel after them, and the post-hook takes rank 0's: only
  here can a rank hold no rows, and a checkpoint load never writes the per-tensor values of a rank
  that holds none (it has nothing to read), so its own may be stale;
- COLS (Shard(1)): planes of exactly the shard's shape, concatenated by FSDP2 along dim 1.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from qgather.model.case import ShardLayout

__all__ = ["WireLayout", "WireMeta", "WireMode", "pack_bytes", "pack_planes", "unpack_planes"]


class WireMode(str, enum.Enum):
    """How the row buffers travel (see the module docstring)."""

    ROWS = "rows"
    PLANES = "planes"
    SINGLE = "single"
    COLS = "cols"


@dataclass(frozen=True)
class WireLayout:
    """What every rank put on the wire, identical on all ranks (derived from shapes only)."""

    fmt: str
    full_shape: tuple[int, ...]
    world_size: int
    mode: WireMode
    buffers: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # name, dtype, padded shape
    per_tensor: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = ()  # sent after them (PLANES)

    @property
    def shard_layout(self) -> ShardLayout:
        """The dim-0 shard layout of the full weight over the world."""
        return ShardLayout(self.full_shape[0], self.world_size, math.prod(self.full_shape[1:-1]))


@dataclass
class WireMeta:
    """The metadata the pre-hook hands FSDP2 for the post-hook: the wire layout and the per-tensor
    values (amax, scale) every rank holds alike."""

    layout: WireLayout
    glob: dict[str, torch.Tensor]


def pack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after the other, as one flat uint8 tensor."""
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])


def pack_planes(tensors: list[torch.Tensor], plane_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors' bytes in as many zero-padded uint8 planes of `plane_shape` as they need (at least one)."""
    flat = pack_bytes(tensors)
    plane_numel = math.prod(plane_shape)
    n_planes = max(1, math.ceil(flat.numel() / plane_numel))
    padded = flat.new_zeros(n_planes * plane_numel)
    padded[: flat.numel()] = flat
    return tuple(padded.view(n_planes, *plane_shape).unbind(0))


def unpack_planes(section, buffers) -> dict[str, torch.Tensor]:
    """The named buffers (name, dtype, shape) read back, in order, from one rank's planes."""
    flat = torch.cat([p.reshape(-1) for p in section])
    out, offset = {}, 0
    for name, dtype, shape in buffers:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        chunk = flat[offset : offset + nbytes]
        if offset % itemsize:  # a buffer after one of an odd byte count (e.g. K = 17): view needs alignment
            chunk = chunk.clone()
        out[name] = chunk.view(dtype).reshape(shape)
        offset += nbytes
    return out
