"""Zoo bugs in how a shard is cut, padded and sized: the reference's QuantizedParam with its alignment
check dropped, its slice handler ignoring `end`, its uneven shards left unpadded, its `new_zeros`
handler missing, or its wire sized by the world instead of the shard mesh (each class's docstring
says which real failure it models; qgather.impls.mutants.table says how each is caught).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from qgather.impls.mutants.base import Mutant
from qgather.impls.reference import QuantizedParam, WireMode
from qgather.impls.reference.ops import aten


class MisalignedShardParam(QuantizedParam):
    """Models TransformerEngine's NVFP4 hooks without their `shard_M % 16 == 0` assertion.

    Slicing the full weight's buffers at row 18 is still exact (the rowwise scales of 2D NVFP4
    are stored per row), so the first all-gather looks fine. But the optimizer step re-quantizes
    each 18-row shard on its own 16x16 tile grid, which starts at the shard's first row: the tiles
    of every rank but the first straddle the global tiles, and the gathered weight silently carries
    tile scales (and codes) computed over the wrong rows. (With 17-row shards the re-quantization
    itself refuses: NVFP4 needs an even row count, the same FormatError on every rank.)"""

    def _check_alignment(self, start_dim0: int, what: str) -> None:
        # BUG: the shard-boundary check was dropped; shards may start inside a scale block.
        return None


class SliceIgnoresBoundsParam(QuantizedParam):
    """Models a dispatch handler for `aten.slice` written for "FSDP2 only narrows a shard to
    itself": it honours `start` but takes the slice to the end of the tensor, ignoring `end`.

    FSDP2 pre-pads every shard (`new_zeros(padded)`), copies the rank's chunk into
    `padded.narrow(0, 0, length)` and keeps that narrow as the local shard. On the ranks whose
    chunk is shorter than the padded size (uneven shards) the narrow is the whole padded tensor,
    so the copy sees mismatched shapes and raises on those ranks only; the others go on into the
    all-gather and wait."""

    def _slice(self, dim: int, start: int | None, end: int | None, step: int) -> QuantizedParam:
        # BUG: `end` is ignored: the slice always runs to the end of dim 0.
        return super()._slice(dim, start, None, step)


class UnpaddedUnevenParam(QuantizedParam):
    """Models TransformerEngine's Float8Tensor pre-hook, which returns the shard's own buffers
    `(self._data,)` whatever the shard size. FSDP2 needs every input at the padded shard size when
    shards are uneven; it checks that only on the ranks whose shard is short (the pytorch NOTE:
    "this error can only be raised on the ranks that have padding"), so those ranks raise while
    the full ranks enter the all-gather and wait for them."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, metadata = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        if metadata.layout.mode is WireMode.PLANES:
            # BUG: uneven shards go on the wire as they are, unpadded.
            return tuple(self._rows.values()), metadata
        return inputs, metadata


class HpFallbackParam(QuantizedParam):
    """Models a subclass without a `new_zeros` handler, whose dispatch runs every unhandled op on
    the dequantized weight (TransformerEngine's QuantizedTensor: "Default op: dequantize and
    perform op").

    FSDP2 pre-pads each shard with `param.new_zeros(padded_size)` and copies the rank's chunk into
    it: the padded shard is then a plain bf16 tensor holding the dequantized chunk, FSDP2 finds no
    all-gather hooks on it, gathers bf16 and the layer computes with a bf16 weight. Every value can
    still match the golden's dequantized weight; the bytes on the wire are bf16."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # BUG: new_zeros / new_empty have no handler and fall through to the high-precision path.
        # (Ops whose first argument is a plain tensor, such as copy_ into that result, must take
        # the same path: the reference's handlers expect a QuantizedParam there.)
        if func in (aten.new_zeros.default, aten.new_empty.default) or not (
            args and isinstance(args[0], QuantizedParam)
        ):
            def unwrap(t: QuantizedParam) -> torch.Tensor:
                return t.dequantize().to(t.dtype).reshape(t.shape)

            args, kwargs = tree_map_only(QuantizedParam, unwrap, (args, kwargs))
            return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


class HpFallbackStep(Mutant):
    """The adapter of `mutant:hp_fallback`: its optimizer step writes the plain high-precision shard
    the fallback left, so the steps scenario shows the bug (DEGRADED), not an adapter error."""

    def requantize_shard(self, local, master_rows, group) -> None:
        if isinstance(local, QuantizedParam):
            super().requantize_shard(local, master_rows, group)
            return
        # The fallback left a plain high-precision shard: the optimizer step writes it as it is.
        with torch.no_grad():
            local.copy_(master_rows.reshape(local.shape).to(local.dtype))


class WorldNotShardMeshParam(QuantizedParam):
    """Models a pre-hook that sizes its wire by the global world (dist.get_world_size()) instead of
    the FSDP mesh it is handed: under HSDP the shard mesh is smaller than the world, so the padded
    wire is cut for shards a fraction of the real size and every rank fails in the hook."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        # BUG: the world's size where the shard mesh's is meant.
        return super().fsdp_pre_all_gather(_SizedMesh(dist.get_world_size()), orig_size, contiguous_orig_stride,
                                           module, mp_policy)


class _SizedMesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self, dim: int | None = None) -> int:
        return self._size
