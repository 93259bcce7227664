"""Zoo bugs in state that outlives one all-gather: an optimizer step that re-quantizes with the shard's
own amax (or the amax of FSDP2's shard mesh only, under tensor parallelism) or leaves the columnwise
copy stale, an `out=` re-gather that keeps old scales or layout (or, for a weight FSDP2 keeps after
forward, stores the wrong one), a checkpoint or a torch.compile rebuild that drops the per-tensor
scale, a checkpoint load that never reaches the per-tensor scale of a rank without rows, a scale
cache one weight leaves behind for the next (each class's docstring says which real failure it
models; qgather.impls.mutants.table says how each is caught).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from qgather.impls.mutants.base import Mutant
from qgather.impls.reference import QuantizedParam, WireMeta


class PerRankAmaxStep(Mutant):
    """Models a quantizer that re-quantizes each shard after the optimizer step with the shard's
    own amax (TE's current-scaling quantizer without `with_amax_reduction`), while the pre-hook's
    metadata carries the local rank's amax for the whole gathered tensor, as TE's NVFP4 hooks do.

    The rows of magnitude 2^-6 and those of 2^6 now have different global scales, and every
    rank's unsharded weight claims its own amax: the ranks disagree with each other (and with a
    single-device quantization of the full weight)."""

    def _global_amax(self, local, master_rows, group):
        if not local._glob:
            return None
        # BUG: the amax all-reduce across the shards is missing.
        if not master_rows.numel():
            return master_rows.new_zeros((), dtype=torch.float32)
        return master_rows.detach().abs().amax().float()


class AmaxGroupFromHookParam(QuantizedParam):
    """Half of bug class 24: the parameter takes the process group its per-tensor amax is reduced
    over from the mesh FSDP2 hands its pre-all-gather hook, as TransformerEngine's FSDP2 path sets
    its quantizer's `amax_reduction_group` from the parameter's FSDP mesh (module/base.py's
    reset_parameters; the hooks likewise). That mesh is FSDP2's shard mesh: the whole weight's
    ranks without tensor parallelism (and the shard dimension under HSDP, whose replicas hold the
    same values), but only the "dp" ranks of one TP piece under tp-DxT."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        if hasattr(mesh, "get_group"):  # a real DeviceMesh (the virtual scenario's has no group)
            # BUG (with AmaxOverShardMeshStep): the shard mesh is taken for every rank holding the weight.
            self._amax_group = mesh.get_group()
        return super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)


class AmaxOverShardMeshStep(Mutant):
    """Models an optimizer step that re-quantizes a shard with the amax all-reduced over FSDP2's
    shard mesh (the group the pre-hook recorded, AmaxGroupFromHookParam) instead of every rank that
    holds a piece of the weight. Exact under flat FSDP2 and HSDP; under tensor parallelism every TP
    piece gets its own amax, so a piece of small rows is scaled by its own maximum, not the whole
    weight's: the gathered piece differs from its slice of the one-device quantization (the ranks
    of one piece agree with each other). Before the first gather no hook has run and the group the
    harness hands the step is used, so the first gather is still right."""

    def _global_amax(self, local, master_rows, group):
        # BUG: the shard mesh's group (the "dp" ranks of one TP piece) where every rank's is meant.
        return super()._global_amax(local, master_rows, getattr(local, "_amax_group", None) or group)


class StaleDerivedStep(Mutant):
    """Models a transpose cache / columnwise copy that the optimizer-step path does not refresh
    (TE's FP8 weights kept a `_transpose` cache that had to be invalidated whenever the data
    changed): the shard is re-quantized for its rowwise usage only, so the columnwise data and
    scales gathered after the step are still those of the initial weight, while the rowwise data
    and the amax are new."""

    def requantize_shard(self, local, master_rows, group) -> None:
        rows, glob = self._requantized(local, master_rows, group)
        # BUG: only the rowwise buffers are written back; the columnwise copy keeps its old values.
        local._assign({n: t for n, t in rows.items() if not n.startswith("columnwise")}, glob)


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


@dataclass
class _KeptWireMeta(WireMeta):
    unsharded_kept: bool = False  # FSDP2 keeps the unsharded weight from forward to backward


def _reshards_after_forward(module) -> bool:
    """FSDP2's own flag, read the way TransformerEngine's hooks read it (False: not resharded
    after forward, i.e. reshard_after_forward=False, or a root module left at its default)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    group = getattr(state, "_fsdp_param_group", None)
    return True if group is None else bool(group._reshard_after_forward)


class _KeptBranchParam(QuantizedParam):
    """Hooks with a branch of their own for a weight FSDP2 keeps after forward: the pre-hook tells the
    post-hook, in the metadata, whether this gather's weight is kept (the two mutants below break
    that branch each in its own way)."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, meta = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        return inputs, _KeptWireMeta(meta.layout, meta.glob, not _reshards_after_forward(module))


class NoReshardStaleLayoutParam(_KeptBranchParam):
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

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if out is None or not metadata.unsharded_kept:
            return super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        fresh, _ = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype)
        # BUG: only the gathered rows are refreshed; the layout and scales built with `out` are kept.
        for name, t in fresh._rows.items():
            out._rows[name].copy_(t)
        return None


class EmptyShardStaleScaleParam(QuantizedParam):
    """Models a subclass that keeps its per-tensor values (scale, amax) on every shard and builds the
    gathered weight with its own rank's, as TransformerEngine's Float8Tensor hooks hand their
    `_scale_inv` to the post-hook as metadata. Every rank holds the same values as long as they are
    computed together (an amax all-reduce after each step). But torch.distributed.checkpoint loads a
    shard by reading the saved chunks that overlap it: a rank that holds no rows (fewer rows, or
    experts, than ranks) reads nothing, and its values stay those the model was built with. Its
    gathered weight dequantizes the loaded bytes with them, while the other ranks' is right.

    The reference sends rank 0's values with the shards where a rank can hold no rows (uneven
    shards) and every rank uses those; this subclass uses its own."""

    def _per_tensor_values(self, outputs, metadata):
        # BUG: this rank's own per-tensor values, which a checkpoint load never wrote on an empty shard.
        return {n: t.clone() for n, t in metadata.glob.items()}


class KeptOutScaleParam(_KeptBranchParam):
    """Models hooks that branch on FSDP2's `_fsdp_param_group._reshard_after_forward`, as
    TransformerEngine's Float8/MXFP8 hooks do, with an `out=` branch of their own for a weight FSDP2
    keeps after forward, written after torchao's float8 post-hook: that branch is one line,
    `out._scale = scale`, the multiplier from high precision to float8. Ported to a tensor that holds
    TransformerEngine's inverse (`scale_inv`), the line stores the scale where its inverse belongs.

    FSDP2 keeps a root module's weight after its forward (it sets the root's post-forward mesh to
    None at its first forward, so the flag reads False from then on), and so re-gathers it through
    `out=` in that branch: the eager and the compiled forward of a `compile` case both receive a
    weight dequantized with scale instead of 1/scale. The first unshard (before any forward) and
    every re-gather of a module no forward has run (the default steps and reshard scenarios) take
    the right branch."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if out is None or not metadata.unsharded_kept:
            return super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        # BUG: the scale (high precision -> float8) is stored where the tensor holds its inverse.
        scale = {name: t.reciprocal() if name == "scale_inv" else t for name, t in metadata.glob.items()}
        return super().fsdp_post_all_gather(all_gather_outputs, _KeptWireMeta(metadata.layout, scale, True),
                                            param_dtype, out=out)


class SharedScaleCacheParam(QuantizedParam):
    """Models a cache of the per-tensor scale keyed too coarsely: one slot per parameter class where
    there must be one per weight (a scaling-state slot shared by every weight of a module, as an
    fp8_meta index two weights share, or a quantizer object whose cached scale every weight of a
    recipe reads). The post-hook fills the slot at the first all-gather after a quantization and
    takes the per-tensor values (scale_inv, amax) from it thereafter; a quantization (a new weight,
    an optimizer step's re-quantization, a checkpoint load) empties it, so a stale scale never
    survives an update.

    A module of one quantized weight never notices: the slot always holds that weight's own values,
    in every scenario and configuration. In a module of several, every weight gathered after the
    first in the same iteration is dequantized with the first one's per-tensor values."""

    _scale_cache: ClassVar[dict[type, dict[str, torch.Tensor]]] = {}

    @classmethod
    def from_weight(cls, fmt, weight):
        cls._scale_cache.pop(cls, None)
        return super().from_weight(fmt, weight)

    def _assign(self, rows, glob) -> None:
        type(self)._scale_cache.pop(type(self), None)
        super()._assign(rows, glob)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if metadata.glob:
            # BUG: one slot per class, not per weight: the first weight gathered fills it for all.
            cached = type(self)._scale_cache.setdefault(type(self), {n: t.clone() for n, t in metadata.glob.items()})
            metadata = WireMeta(metadata.layout, {n: t.clone() for n, t in cached.items()})
        return super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
