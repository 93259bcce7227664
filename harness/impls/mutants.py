"""The bug zoo: one deliberately broken variant of the reference implementation per bug class of
docs/bug-classes.md, so that the harness can prove it detects (and names) every one of them.

Each mutant is the reference `QuantizedParam` with one small method overridden (or, where the
bug lives in the optimizer-step path, one method of `ReferenceImplementation`), modelled on how
that bug occurs in real FSDP2 hooks of TransformerEngine / torchao-style tensor subclasses; the
docstring of each says which real failure it models. Every mutant's implementation class carries

  bug_class       the number of the bug class in docs/bug-classes.md
  expected        the verdict the harness must give it (qgather.model.verdict.Verdict)
  verdicts        every failing verdict consistent with the bug (`qgather selftest --suite` counts
                  any other failing verdict as a wrong-class verdict); defaults to {expected}
  catching_cases  case ids (with the mutant's own name) on which that verdict shows, while the
                  reference passes the same case (see qgather.tools.selftest)

`qgather.impls` registers `FACTORIES`, so every mutant runs like any implementation:
`qgather case mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map_only

from qgather.formats import FORMATS
from qgather.formats import numerics as nx
from qgather.formats.nvfp4 import Nvfp4_1DFormat, Nvfp4_2DFormat
from qgather.impls.reference import QuantizedParam, ReferenceImplementation, WireMeta
from qgather.impls.reference.ops import aten
from qgather.impls.reference.wire import WireMode, pack_bytes, unpack_planes
from qgather.model.verdict import Verdict

__all__ = ["FACTORIES", "MUTANTS", "Mutant"]


class Mutant(ReferenceImplementation):
    """Base of the zoo's implementations: the reference adapter with a broken parameter class."""

    bug: str = ""
    bug_class: int = 0
    expected: Verdict = Verdict.EXACT
    #: verdicts that count as caught besides `expected`, which every mutant's set includes
    verdicts: frozenset[Verdict] = frozenset()
    catching_cases: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.bug:
            cls.name = f"mutant:{cls.bug}"
            cls.verdicts = frozenset(cls.verdicts) | {cls.expected}


def _cases(bug: str, *cases: str) -> tuple[str, ...]:
    return tuple(f"mutant:{bug}:{case}" for case in cases)


# ====================================================================== 1. misaligned shard
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


class MisalignedShard(Mutant):
    bug, bug_class = "misaligned_shard", 1
    # Without the check, a misaligned shard also reaches shard-level code that fails on the
    # misaligned ranks only (e.g. an odd 43-row NVFP4 shard at 3 ranks): ERROR, or HANG/CRASH.
    verdicts = frozenset({Verdict.SILENT_MISMATCH, Verdict.RANK_DIVERGENCE, Verdict.ERROR, Verdict.HANG,
                          Verdict.CRASH})
    param_class = MisalignedShardParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_2d:144x64:bf16:ws8:steps:s0")


# ====================================================================== 2. trim to fit
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


class TrimToFit(Mutant):
    bug, bug_class = "trim_to_fit", 2
    verdicts = MisalignedShard.verdicts  # built on misaligned_shard, whose failures it keeps
    param_class = TrimToFitParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_1d:136x64:bf16:ws8:gather:s0")


# ====================================================================== 3. slice ignores bounds
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


class SliceIgnoresBounds(Mutant):
    bug, bug_class = "slice_ignores_bounds", 3
    verdicts = frozenset({Verdict.ERROR, Verdict.HANG, Verdict.CRASH, Verdict.SILENT_MISMATCH, Verdict.RANK_DIVERGENCE})
    param_class = SliceIgnoresBoundsParam
    expected = Verdict.ERROR
    catching_cases = _cases(bug, "nvfp4_2d:3x16x64:bf16:ws2:gather:s0")


# ====================================================================== 4. missing usage
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


class MissingUsage(Mutant):
    bug, bug_class = "missing_usage", 4
    param_class = MissingUsageParam
    expected = Verdict.ERROR
    catching_cases = _cases(bug, "nvfp4_2d:128x64:bf16:ws2:gather:s0")


# ====================================================================== 5. columnwise not transposed
class ColumnwiseNotTransposedParam(QuantizedParam):
    """Models a post-hook that receives the columnwise data gathered along dim 0 (each rank's
    rows of x, packed in pairs: (M/2, K)) and stores it in TransformerEngine's transposed
    (K, M/2) columnwise buffer with a reshape, as if it had been gathered transposed: the shape
    fits, the bytes are in row order instead of column order."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        param = out if out is not None else result[0]
        stacked = param._rows["columnwise_data"]  # (M/2, K), the shards stacked along dim 0
        # BUG: reshaped into the (K, M/2) slot instead of transposed back (stacked.t()).
        param._te["columnwise_data"].copy_(stacked.reshape(param._te["columnwise_data"].shape))
        return result


class ColumnwiseNotTransposed(Mutant):
    bug, bug_class = "columnwise_not_transposed", 5
    param_class = ColumnwiseNotTransposedParam
    formats = ("nvfp4_1d",)  # the format whose columnwise data is gathered
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_1d:128x64:bf16:ws2:gather:s0")


# ====================================================================== 6. per-rank amax
class PerRankAmax(Mutant):
    """Models a quantizer that re-quantizes each shard after the optimizer step with the shard's
    own amax (TE's current-scaling quantizer without `with_amax_reduction`), while the pre-hook's
    metadata carries the local rank's amax for the whole gathered tensor, as TE's NVFP4 hooks do.

    The rows of magnitude 2^-6 and those of 2^6 now have different global scales, and every
    rank's unsharded weight claims its own amax: the ranks disagree with each other (and with a
    single-device quantization of the full weight)."""

    bug, bug_class = "per_rank_amax", 6
    verdicts = frozenset({Verdict.RANK_DIVERGENCE, Verdict.SILENT_MISMATCH})
    expected = Verdict.RANK_DIVERGENCE
    catching_cases = _cases(bug, "nvfp4_2d:128x64:bf16:ws2:steps:s0")

    def _global_amax(self, local, master_rows, group):
        if not local._glob:
            return None
        # BUG: the amax all-reduce across the shards is missing.
        if not master_rows.numel():
            return master_rows.new_zeros((), dtype=torch.float32)
        return master_rows.detach().abs().amax().float()


# ====================================================================== 7. columnwise derived in 1D
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


class DeriveColumnwise1D(Mutant):
    bug, bug_class = "derive_columnwise_1d", 7
    param_class = DeriveColumnwise1DParam
    formats = ("nvfp4_1d",)
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_1d:128x64:bf16:ws2:gather:s0")


# ====================================================================== 8. scale padding
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


class ScalePadding(Mutant):
    bug, bug_class = "scale_padding", 8
    param_class = ScalePaddingParam
    formats = ("nvfp4_1d", "nvfp4_2d")
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_2d:128x64:bf16:ws2:gather:s0")


# ====================================================================== 9. unpadded uneven shards
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


class UnpaddedUneven(Mutant):
    bug, bug_class = "unpadded_uneven", 9
    verdicts = frozenset({Verdict.ERROR, Verdict.HANG, Verdict.CRASH})
    param_class = UnpaddedUnevenParam
    expected = Verdict.ERROR
    catching_cases = _cases(bug, "fp8_tensor:5x64:bf16:ws2:gather:s0")


# ====================================================================== 10. stale out= path
class StaleOutParam(QuantizedParam):
    """Models the `out=` branch of a post-hook (second and later all-gathers) that refreshes the
    gathered data but not the per-tensor values. In torchao's float8 hooks the data arrive in
    place and that branch is a single `out._scale = scale; return`: without that line the
    unsharded weight keeps the first all-gather's scale. After an optimizer step the weight is
    then quantized with the new scale and dequantized with the old one."""

    def _refresh(self, rows, glob, te) -> None:
        for name, t in rows.items():
            self._rows[name].copy_(t)
        for name, t in te.items():
            # BUG: the per-tensor values (scale_inv, amax) are not refreshed, here nor in _glob.
            if name not in glob:
                self._te[name].copy_(t)


class StaleOut(Mutant):
    bug, bug_class = "stale_out", 10
    param_class = StaleOutParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "fp8_tensor:128x64:bf16:ws2:reshard:s0")


# ====================================================================== 11. high-precision fallback
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


class HpFallback(Mutant):
    bug, bug_class = "hp_fallback", 11
    param_class = HpFallbackParam
    expected = Verdict.DEGRADED
    catching_cases = _cases(bug, "nvfp4_2d:128x64:bf16:ws2:gather:s0")

    def requantize_shard(self, local, master_rows, group) -> None:
        if isinstance(local, QuantizedParam):
            super().requantize_shard(local, master_rows, group)
            return
        # The fallback left a plain high-precision shard: the optimizer step writes it as it is.
        with torch.no_grad():
            local.copy_(master_rows.reshape(local.shape).to(local.dtype))


# ====================================================================== 12. nibble order
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


class NibbleSwap(Mutant):
    bug, bug_class = "nibble_swap", 12
    param_class = NibbleSwapParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_2d:128x64:bf16:ws2:gather:s0")


# ====================================================================== 13. world size 1 path
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


class Ws1Path(Mutant):
    bug, bug_class = "ws1_path", 13
    param_class = Ws1PathParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_1d:128x64:bf16:ws1:gather:s0")


# ====================================================================== 14. stale derived data
class StaleDerived(Mutant):
    """Models a transpose cache / columnwise copy that the optimizer-step path does not refresh
    (TE's FP8 weights kept a `_transpose` cache that had to be invalidated whenever the data
    changed): the shard is re-quantized for its rowwise usage only, so the columnwise data and
    scales gathered after the step are still those of the initial weight, while the rowwise data
    and the amax are new."""

    bug, bug_class = "stale_derived", 14
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_1d:128x64:bf16:ws2:steps:s0")

    def requantize_shard(self, local, master_rows, group) -> None:
        rows, glob = self._requantized(local, master_rows, group)
        # BUG: only the rowwise buffers are written back; the columnwise copy keeps its old values.
        local._assign({n: t for n, t in rows.items() if not n.startswith("columnwise")}, glob)


# ====================================================================== 15. mixed precision ignored
class IgnoresParamDtypeParam(QuantizedParam):
    """Models a post-hook that builds the unsharded weight with the shard's own dtype (the masters')
    instead of the `param_dtype` FSDP2 hands it from the MixedPrecisionPolicy: the bytes are right,
    the layer computes in fp32 where the policy asked for bf16."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        # BUG: the policy's param_dtype is ignored.
        return super().fsdp_post_all_gather(all_gather_outputs, metadata, self.dtype, out=out)


class IgnoresParamDtype(Mutant):
    bug, bug_class = "ignores_param_dtype", 15
    param_class = IgnoresParamDtypeParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "nvfp4_2d:128x64:fp32:ws2:gather:s0:mp-bf16")


# ====================================================================== 16. assumes dim-0 sharding
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


class AssumesDim0(Mutant):
    bug, bug_class = "assumes_dim0", 16
    param_class = AssumesDim0Param
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "fp8_tensor:128x64:bf16:ws2:gather:s0:dim1")


# ====================================================================== 17. HSDP: world instead of shard mesh
class WorldNotShardMeshParam(QuantizedParam):
    """Models a pre-hook that sizes its wire by the global world (dist.get_world_size()) instead of
    the FSDP mesh it is handed: under HSDP the shard mesh is smaller than the world, so the padded
    wire is cut for shards a fraction of the real size and every rank fails in the hook."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        import torch.distributed as dist

        # BUG: the world's size where the shard mesh's is meant.
        return super().fsdp_pre_all_gather(_SizedMesh(dist.get_world_size()), orig_size, contiguous_orig_stride,
                                           module, mp_policy)


class _SizedMesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self, dim: int | None = None) -> int:
        return self._size


class WorldNotShardMesh(Mutant):
    bug, bug_class = "world_not_shard_mesh", 17
    verdicts = frozenset({Verdict.ERROR, Verdict.SILENT_MISMATCH, Verdict.RANK_DIVERGENCE})
    param_class = WorldNotShardMeshParam
    expected = Verdict.ERROR
    catching_cases = _cases(bug, "nvfp4_2d:128x64:bf16:ws4:gather:s0:hsdp-2x2")


# ====================================================================== 18. scale lost in a checkpoint
class CheckpointDropsScaleParam(QuantizedParam):
    """Models a subclass whose serialized state holds its data but not its per-tensor values (a
    scale kept as a non-persistent attribute, re-derived on load): torch.distributed.checkpoint
    saves each shard with torch.save and, on load, copies the rebuilt shard into the model's. The
    data survive; the scale comes back as its default, 1. Eager training never notices."""

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # BUG: the per-tensor values are not part of the saved state; only their shapes are.
        state["glob"] = {n: torch.ones_like(t) for n, t in self._glob.items()}
        return state


class CheckpointDropsScale(Mutant):
    bug, bug_class = "checkpoint_drops_scale", 18
    param_class = CheckpointDropsScaleParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "fp8_tensor:128x64:bf16:ws2:gather:s0:dcp-ws4")


# ====================================================================== 19. unflatten drops metadata
class UnflattenDropsScaleParam(QuantizedParam):
    """Models a `__tensor_unflatten__` that rebuilds the subclass from its data but takes the
    per-tensor values from defaults instead of what `__tensor_flatten__` handed over (as a subclass
    does that treats its scale as metadata and forgets it in the unflatten). Only torch.compile
    takes that path (Dynamo and AOTAutograd rebuild every subclass input with it): the eager forward
    is right, the compiled one multiplies by the wrong scale."""

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        param = super().__tensor_unflatten__(inner, meta, outer_size, outer_stride)
        # BUG: the per-tensor values are reset instead of taken from the inner tensors.
        param._glob = {n: torch.ones_like(t) for n, t in param._glob.items()}
        return param


class UnflattenDropsScale(Mutant):
    bug, bug_class = "unflatten_drops_scale", 19
    param_class = UnflattenDropsScaleParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "fp8_tensor:128x64:bf16:ws2:gather:s0:compile")


# ====================================================================== 20. no reshard after forward: stale layout
@dataclass
class _KeptWireMeta(WireMeta):
    unsharded_kept: bool = False  # FSDP2 keeps the unsharded weight from forward to backward


def _reshards_after_forward(module) -> bool:
    """FSDP2's own flag, read the way TransformerEngine's hooks read it (False: not resharded
    after forward, i.e. reshard_after_forward=False, or a root module left at its default)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    group = getattr(state, "_fsdp_param_group", None)
    return True if group is None else bool(group._reshard_after_forward)


class NoReshardStaleLayoutParam(QuantizedParam):
    """Models hooks that branch on FSDP2's `_fsdp_param_group._reshard_after_forward`, as
    TransformerEngine's Float8/MXFP8 hooks do, and take the comment of TE's MXFP8 pre-hook at its
    word: "If weights are not resharded after forward pass, weights allgathered in forward are used
    in backward and pre/post allgather methods wont be called". In that branch the post-hook
    treats its unsharded tensor as built once: the `out=` path copies the newly gathered data into
    the row buffers and keeps the layout GEMMs read (re-padded scales, the derived or transposed
    columnwise copy, the per-tensor scale_inv and amax) that it built with `out` on the first
    all-gather.

    But FSDP2 still reshards after backward and re-gathers every iteration into the same `out`
    (FSDPParam.init_unsharded_param, once `_unsharded_param` exists): after an optimizer step the
    weight's layout and scale are those of the first iteration. With resharding after forward (the
    default of every non-root module, and of a root module that is never run forward) the branch
    is not taken and every re-gather is right."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, meta = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        return inputs, _KeptWireMeta(meta.layout, meta.glob, not _reshards_after_forward(module))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if out is None or not metadata.unsharded_kept:
            return super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        fresh, _ = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype)
        # BUG: only the gathered rows are refreshed; the layout and scales built with `out` are kept.
        for name, t in fresh._rows.items():
            out._rows[name].copy_(t)
        return None


class NoReshardStaleLayout(Mutant):
    bug, bug_class = "no_reshard_stale_layout", 20
    param_class = NoReshardStaleLayoutParam
    expected = Verdict.SILENT_MISMATCH
    catching_cases = _cases(bug, "fp8_tensor:128x64:bf16:ws2:steps:s0:raf-no")


MUTANTS: tuple[type[Mutant], ...] = tuple(
    sorted(
        (
            MisalignedShard, TrimToFit, SliceIgnoresBounds, MissingUsage, ColumnwiseNotTransposed,
            PerRankAmax, DeriveColumnwise1D, ScalePadding, UnpaddedUneven, StaleOut, HpFallback,
            NibbleSwap, Ws1Path, StaleDerived, IgnoresParamDtype, AssumesDim0, WorldNotShardMesh,
            CheckpointDropsScale, UnflattenDropsScale, NoReshardStaleLayout,
        ),
        key=lambda m: m.bug_class,
    )
)

FACTORIES: dict[str, type[Mutant]] = {m.name: m for m in MUTANTS}
