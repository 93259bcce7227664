"""The reference adapter, `ReferenceImplementation`: qgather's own subclass (QuantizedParam) offered
to the harness as an implementation, the expected behaviour every other implementation is judged by:
how it builds, reads and re-quantizes its parameter, and how many bytes its wire may move.

Mutants in `qgather.impls.mutants` subclass it (and QuantizedParam) and override one small method
each, so every method here does one thing.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.distributed as dist

from qgather.formats import FORMATS, Format, FormatError
from qgather.impls.base import PACKED_SLACK, Implementation
from qgather.impls.reference.param import QuantizedParam, ShardAlignmentError
from qgather.model.case import ShardLayout

__all__ = ["ReferenceImplementation", "per_tensor_bytes"]


@cache
def per_tensor_bytes(fmt_name: str) -> int:
    """Bytes of a format's per-tensor values (its row layout's `glob`: a scale, amaxes)."""
    fmt = FORMATS[fmt_name]
    probe = torch.ones(math.lcm(fmt.m_multiple, fmt.row_block, 2), math.lcm(fmt.k_multiple, 32))
    _rows, glob = fmt.to_rows(fmt.quantize(probe))
    return sum(t.numel() * t.element_size() for t in glob.values())


class ReferenceImplementation(Implementation):
    """qgather's own subclass: the expected behaviour every other implementation is judged by."""

    name = "reference"
    formats = tuple(FORMATS)
    param_class: type[QuantizedParam] = QuantizedParam
    rejection_types = (ShardAlignmentError, FormatError)

    def wire_allowance(self, fmt: str, shape: tuple[int, ...], shards: ShardLayout, packed_bytes: int):
        if getattr(shards, "shard_dim", 0) == 1 and shards.world_size > 1:
            # Shard(1): whole uint8 planes of the shard's shape (see _pre_all_gather_cols)
            plane = shards.dim0 * shards.col_chunk
            return "column planes", max(1, math.ceil(packed_bytes / plane)) * plane
        if shards.world_size == 1 or shards.even:
            return super().wire_allowance(fmt, shape, shards, packed_bytes)
        # Uneven shards: FSDP2 wants every input at the padded shard's shape, so the packed bytes
        # travel in byte planes of that shape (see fsdp_pre_all_gather), the per-tensor values after
        # them: whole planes, not bytes.
        plane = shards.chunk * math.prod(shape[1:])
        sent = packed_bytes * PACKED_SLACK + per_tensor_bytes(fmt)
        return "byte planes", max(1, math.ceil(sent / plane)) * plane

    def make_param(self, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        return self.param_class.from_weight(FORMATS[fmt], weight)

    def read_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        if param._te is None:
            raise TypeError(f"{self.name}: the parameter holds no gathered TransformerEngine-layout buffers")
        return dict(param._te)

    def is_quantized(self, param: torch.Tensor) -> bool:
        return isinstance(param, QuantizedParam)

    def requantize_shard(self, local: torch.Tensor, master_rows: torch.Tensor, group) -> None:
        local._assign(*self._requantized(local, master_rows, group))

    def _requantized(self, local: QuantizedParam, master_rows: torch.Tensor, group):
        """The shard's new row buffers and per-tensor values (a zero-row shard has only the latter)."""
        fmt = local._fmt
        amax = self._global_amax(local, master_rows, group)
        if master_rows.shape[0] == 0:
            return {}, self._glob_for_amax(fmt, master_rows, amax)
        q = fmt.quantize(master_rows, amax=amax) if amax is not None else fmt.quantize(master_rows)
        return fmt.to_rows(q)

    def _global_amax(self, local: QuantizedParam, master_rows: torch.Tensor, group) -> torch.Tensor | None:
        """Per-tensor formats scale by the amax of the WHOLE weight: all-reduce the shards' amaxes."""
        if not local._glob:
            return None
        amax = master_rows.detach().abs().amax().float() if master_rows.numel() else master_rows.new_zeros(
            (), dtype=torch.float32
        )
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    @staticmethod
    def _glob_for_amax(fmt: Format, master_rows: torch.Tensor, amax: torch.Tensor | None):
        """A rank with zero rows still keeps the per-tensor values every rank agrees on."""
        if amax is None:
            return {}
        probe = master_rows.new_zeros((fmt.row_block * 2, master_rows.shape[-1]))
        return fmt.to_rows(fmt.quantize(probe, amax=amax))[1]
