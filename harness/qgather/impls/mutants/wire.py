"""Zoo bugs in what the all-gather hooks put on the wire and how they read it back: buffers trimmed to
fit, a dropped usage sent as None, columnwise data reshaped or derived wrong, scales re-padded with
the wrong rule, FP4 nibbles swapped, the world-size-1 path packed out of order, the mixed-precision
dtype ignored, dim-1 shards read as dim-0 blocks (each class's docstring says which real failure it
models; qgather.impls.mutants.table says how each is caught).
"""

from __future__ import annotations

import math

import torch

from qgather.formats import FORMATS
from qgather.formats import numerics as nx
from qgather.formats.nvfp4 import Nvfp4_1DFormat, Nvfp4_2DFormat
from qgather.impls.mutants.sharding import MisalignedShardParam
from qgather.impls.reference import QuantizedParam, WireMode
from qgather.impls.reference.wire import pack_bytes, unpack_planes


class TrimToFitParam(MisalignedShardParam):
    """Models a post-hook that "drops the padding" by cutting every gathered buffer to the entry
    count the full shape implies, instead of failing on a mis-sized gather.

    Built on the misaligned_shard mutant, whose misaligned nvfp4_1d gather is still caught by the
    shape check (8 ranks x ceil(17/16) = 16 columnwise scale blocks arrive for a weight that has 9,
    and 72 packed column pairs for 68: the same FormatError on every rank). The trim makes those
    shapes fit: 7 scale blocks and 4 packed rows are silently discarded, the rest is scrambled."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        layout = metadata.layout
        if layout.mode is WireMode.ROWS:
            rows = math.prod(layout.full_shape[:-1])
            # BUG: whatever arrived is cut to the expected entry count, never checked.
            all_gather_outputs = tuple(
                t[: self._entries(name, rows)] for (name, _, _), t in zip(layout.buffers, all_gather_outputs)
            )
        return super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)


class MissingUsageParam(QuantizedParam):
    """Models TransformerEngine-style hooks on a weight whose rowwise usage was dropped to save
    memory (`update_usage(rowwise_usage=False)`, e.g. once only the columnwise copy is needed for
    the backward GEMMs): the pre-hook hands `_rowwise_data`, which is None, to the all-gather.
    Every rank fails the same way, inside the hook, with an error that names no constraint."""

    def _padded_wire(self, padded_rows: int) -> dict[str, torch.Tensor]:
        wire = super()._padded_wire(padded_rows)
        # BUG: the buffer of a usage the shard no longer holds goes on the wire as None.
        wire["rowwise_data"] = None
        return wire


class ColumnwiseNotTransposedParam(QuantizedParam):
    """Models a post-hook that receives the columnwise data gathered along dim 0 (each rank's
    rows of x, packed in pairs: (M/2, K)) and stores it in TransformerEngine's transposed
    (K, M/2) columnwise buffer with a reshape, as if it had been gathered transposed: the shape
    fits, the bytes are in row order instead of column order."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        param = out if out is not None else result[0]
        # (M/2, K), the shards stacked along dim 0; a copy, as a library's gathered buffer is its own memory
        # (the reference's transposed slot views these rows: an overlapping copy would raise, a crash the bug
        # does not have; at M/2 = 1 a reshape is a transpose, and the bug does not show)
        stacked = param._rows["columnwise_data"].clone()
        # BUG: reshaped into the (K, M/2) slot instead of transposed back (stacked.t()).
        param._te["columnwise_data"].copy_(stacked.reshape(param._te["columnwise_data"].shape))
        return result


class DeriveColumnwise1DParam(QuantizedParam):
    """Models TransformerEngine 2.20.2's NVFP4 post-hook ("derives columnwise locally", by
    transposing the rowwise tiles) applied to a 1D-scaled weight. Only 16x16 tiles transpose
    exactly; with 1x16 blocks the result takes each 16-row group's first row of scales for the
    whole group and never matches the columnwise quantization of x^T."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        param = out if out is not None else result[0]
        rowwise = {n: param._rows[n] for n in FORMATS["nvfp4_2d"].rows_per_entry}
        # BUG: the 2D derivation (transpose the rowwise tiles) on 1x16-block data.
        derived = FORMATS["nvfp4_2d"].from_rows(rowwise, param._glob, param._shape)
        for name in ("columnwise_data", "columnwise_scale_inv"):
            param._te[name].copy_(derived.buffers[name])
        return result


class _ColumnwiseScalesPaddedLikeRowwise:
    """NVFP4 buffer specs with the M axis of the columnwise scales padded to a multiple of 128
    (the rule for the rowwise scales' M axis) instead of 4."""

    def buffer_specs(self, shape):
        specs = super().buffer_specs(shape)
        (k_rows, _), dtype = specs["columnwise_scale_inv"]
        m_blocks = nx.ceil_div(math.prod(tuple(shape)[:-1]), 16)
        specs["columnwise_scale_inv"] = ((k_rows, nx.round_up(m_blocks, 128)), dtype)
        return specs


class _MisPadded1D(_ColumnwiseScalesPaddedLikeRowwise, Nvfp4_1DFormat):
    pass


class _MisPadded2D(_ColumnwiseScalesPaddedLikeRowwise, Nvfp4_2DFormat):
    pass


_MISPADDED = {"nvfp4_1d": _MisPadded1D(), "nvfp4_2d": _MisPadded2D()}

class ScalePaddingParam(QuantizedParam):
    """Models a post-hook that re-pads the gathered columnwise scales to the wrong multiple: their
    M axis (ceil(M/16) blocks) is rounded up to 128, the rule of the rowwise scales' M axis, where
    TransformerEngine pads it to 4. The valid scales are intact; the buffer a GEMM would index
    with TE's leading dimension is not."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        if out is None:
            param = result[0]
            param._te = self._mispadded(param._rows, param._glob, param._shape)
        return result

    def _refresh(self, rows, glob, te) -> None:
        super()._refresh(rows, glob, self._mispadded(rows, glob, self._shape))

    def _mispadded(self, rows, glob, shape) -> dict[str, torch.Tensor]:
        # BUG: the re-layout after the gather pads the columnwise scales with the rowwise rule.
        return dict(_MISPADDED.get(self._fmt.name, self._fmt).from_rows(rows, glob, shape).buffers)


def _pack_high_nibble_first(codes: torch.Tensor) -> torch.Tensor:
    """torchao's old `pack_uint4` convention: element 2c in the HIGH nibble (TE puts it low)."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return torch.add(pairs[..., 1], pairs[..., 0], alpha=16)


class NibbleSwapParam(QuantizedParam):
    """Models a pre-hook that unpacks the shard's FP4 codes and re-packs them for the wire with
    torchao's `pack_uint4` convention (first element in the high nibble), while the post-hook
    reads TransformerEngine's (first element in the low nibble). Every byte whose two codes
    differ is silently swapped; scales and amax are untouched."""

    def _padded_wire(self, padded_rows: int) -> dict[str, torch.Tensor]:
        wire = super()._padded_wire(padded_rows)
        for name in ("rowwise_data", "columnwise_data"):
            if name in wire and self._fmt.name.startswith("nvfp4"):
                # BUG: re-packed high nibble first.
                wire[name] = _pack_high_nibble_first(nx.unpack_nibbles(wire[name]))
        return wire


class Ws1PathParam(QuantizedParam):
    """Models a world-size-1 fast path written apart from the multi-rank one. FSDP2 (torch 2.13)
    hands only the first all-gather input to the post-hook at world size 1, so that path packs
    every buffer into one flat byte input; this one serializes the buffers in name order
    (columnwise before rowwise), while the parser it shares with the uneven-shard path reads them
    in storage order. On 2+ ranks it is never taken; with nvfp4_2d (rowwise buffers only, already
    in name order) it happens to be right."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, metadata = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        if metadata.layout.mode is WireMode.SINGLE:
            wire = self._padded_wire(orig_size[0] * math.prod(orig_size[1:-1]))
            # BUG: packed in sorted-name order; metadata.layout lists the storage order.
            inputs = (pack_bytes([wire[name] for name in sorted(wire)]),)
        return inputs, metadata


class IgnoresParamDtypeParam(QuantizedParam):
    """Models a post-hook that builds the unsharded weight with the shard's own dtype (the masters')
    instead of the `param_dtype` FSDP2 hands it from the MixedPrecisionPolicy: the bytes are right,
    the layer computes in fp32 where the policy asked for bf16."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        # BUG: the policy's param_dtype is ignored.
        return super().fsdp_post_all_gather(all_gather_outputs, metadata, self.dtype, out=out)


class AssumesDim0Param(QuantizedParam):
    """Models a post-hook written for dim-0 sharding only: it reads each rank's section as a
    contiguous block of the gathered output (rank r's bytes at [r * numel, (r + 1) * numel)), but under
    Shard(1) FSDP2 has concatenated the ranks along dim 1, so every section interleaves the rows of
    all ranks: the shapes fit, the bytes are scrambled."""

    def _rows_from_columns(self, outputs, layout):
        per_rank = []
        for rank in range(layout.world_size):
            # BUG: rank-major slicing of a dim-1 concatenation.
            section = [o.reshape(layout.world_size, -1)[rank] for o in outputs]
            per_rank.append(unpack_planes(section, layout.buffers))
        return {name: torch.cat([r[name] for r in per_rank], dim=-1) for name, _, _ in layout.buffers}
