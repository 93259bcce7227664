"""The bug zoo as one table: `ZOO`, one `MutantSpec` per bug class of docs/bug-classes.md, each naming
the broken behaviour (sharding.py, wire.py, state.py), the verdict that must catch it and the case
that shows it. `qgather list mutants` prints it; `qgather selftest` proves every row.
"""

from __future__ import annotations

from qgather.impls.mutants import group, sharding, state, wire
from qgather.impls.mutants.base import MutantSpec
from qgather.impls.reference import QuantizedParam
from qgather.model.verdict import Verdict as V

__all__ = ["ZOO"]

# Without the alignment check a misaligned shard also reaches shard-level code that fails on the
# misaligned ranks only (e.g. an odd 43-row NVFP4 shard at 3 ranks): ERROR, or HANG/CRASH.
_SPLIT_BLOCKS = frozenset({V.RANK_DIVERGENCE, V.ERROR, V.HANG, V.CRASH})

ZOO: tuple[MutantSpec, ...] = (
    MutantSpec("misaligned_shard", 1, sharding.MisalignedShardParam, V.SILENT_MISMATCH,
               ("nvfp4_2d:144x64:bf16:ws8:steps:s0",), also=_SPLIT_BLOCKS,
               doc="the shard-boundary check dropped: shards may start inside a scale block"),
    MutantSpec("trim_to_fit", 2, wire.TrimToFitParam, V.SILENT_MISMATCH,
               ("nvfp4_1d:136x64:bf16:ws8:gather:s0",), also=_SPLIT_BLOCKS,  # built on misaligned_shard
               doc="a post-hook that cuts every gathered buffer to the size it expects instead of failing"),
    MutantSpec("slice_ignores_bounds", 3, sharding.SliceIgnoresBoundsParam, V.ERROR,
               ("nvfp4_2d:3x16x64:bf16:ws2:gather:s0",),
               also=frozenset({V.HANG, V.CRASH, V.SILENT_MISMATCH, V.RANK_DIVERGENCE}),
               doc="an aten.slice handler that ignores `end`"),
    MutantSpec("missing_usage", 4, wire.MissingUsageParam, V.ERROR, ("nvfp4_2d:128x64:bf16:ws2:gather:s0",),
               doc="the buffer of a dropped (rowwise) usage goes on the wire as None"),
    MutantSpec("columnwise_not_transposed", 5, wire.ColumnwiseNotTransposedParam, V.SILENT_MISMATCH,
               ("nvfp4_1d:128x64:bf16:ws2:gather:s0",), formats=("nvfp4_1d",),
               doc="gathered columnwise data reshaped into TE's transposed slot instead of transposed"),
    MutantSpec("per_rank_amax", 6, QuantizedParam, V.RANK_DIVERGENCE,
               ("nvfp4_2d:128x64:bf16:ws2:steps:s0",), also=frozenset({V.SILENT_MISMATCH}),
               adapter=state.PerRankAmaxStep,
               doc="each shard re-quantized with its own amax: the amax all-reduce is missing"),
    MutantSpec("derive_columnwise_1d", 7, wire.DeriveColumnwise1DParam, V.SILENT_MISMATCH,
               ("nvfp4_1d:128x64:bf16:ws2:gather:s0",), formats=("nvfp4_1d",),
               doc="columnwise data derived by transposing the rowwise tiles, of 1x16-block data"),
    MutantSpec("scale_padding", 8, wire.ScalePaddingParam, V.SILENT_MISMATCH,
               ("nvfp4_2d:128x64:bf16:ws2:gather:s0",), formats=("nvfp4_1d", "nvfp4_2d"),
               doc="gathered columnwise scales re-padded to 128 rows (the rowwise rule) instead of 4"),
    MutantSpec("unpadded_uneven", 9, sharding.UnpaddedUnevenParam, V.ERROR, ("fp8_tensor:5x64:bf16:ws2:gather:s0",),
               also=frozenset({V.HANG, V.CRASH}),
               doc="uneven shards go on the wire as they are, unpadded"),
    MutantSpec("stale_out", 10, state.StaleOutParam, V.SILENT_MISMATCH, ("fp8_tensor:128x64:bf16:ws2:reshard:s0",),
               doc="the out= re-gather refreshes the data but not the per-tensor scale"),
    MutantSpec("hp_fallback", 11, sharding.HpFallbackParam, V.DEGRADED, ("nvfp4_2d:128x64:bf16:ws2:gather:s0",),
               adapter=sharding.HpFallbackStep,
               doc="no new_zeros handler: FSDP2 pads a dequantized copy and gathers high precision"),
    MutantSpec("nibble_swap", 12, wire.NibbleSwapParam, V.SILENT_MISMATCH, ("nvfp4_2d:128x64:bf16:ws2:gather:s0",),
               doc="FP4 codes re-packed for the wire with the first element in the high nibble"),
    MutantSpec("ws1_path", 13, wire.Ws1PathParam, V.SILENT_MISMATCH, ("nvfp4_1d:128x64:bf16:ws1:gather:s0",),
               doc="the world-size-1 path packs its buffers in name order, not storage order"),
    MutantSpec("stale_derived", 14, QuantizedParam, V.SILENT_MISMATCH,
               ("nvfp4_1d:128x64:bf16:ws2:steps:s0",), adapter=state.StaleDerivedStep,
               doc="an optimizer step refreshes the rowwise buffers only: the columnwise copy goes stale"),
    MutantSpec("ignores_param_dtype", 15, wire.IgnoresParamDtypeParam, V.SILENT_MISMATCH,
               ("nvfp4_2d:128x64:fp32:ws2:gather:s0:mp-bf16",),
               # a module's forward: the policy's bf16 activations against the fp32 weight raise, and the error
               # names the two dtypes (the defect itself; docs/mutation-mode.md, "What counts as a kill")
               also=frozenset({V.ERROR}),
               doc="the post-hook ignores the mixed-precision policy's param_dtype"),
    MutantSpec("assumes_dim0", 16, wire.AssumesDim0Param, V.SILENT_MISMATCH,
               ("fp8_tensor:128x64:bf16:ws2:gather:s0:dim1", "fp8_tensor_e5m2:128x64:bf16:ws2:gather:s0:dim1"),
               doc="a post-hook that reads each rank's section as a dim-0 block under Shard(1)"),
    MutantSpec("world_not_shard_mesh", 17, sharding.WorldNotShardMeshParam, V.ERROR,
               ("nvfp4_2d:128x64:bf16:ws4:gather:s0:hsdp-2x2",),
               also=frozenset({V.SILENT_MISMATCH, V.RANK_DIVERGENCE}),
               doc="the wire sized by the world instead of the shard mesh (HSDP)"),
    MutantSpec("checkpoint_drops_scale", 18, state.CheckpointDropsScaleParam, V.SILENT_MISMATCH,
               ("fp8_tensor:128x64:bf16:ws2:gather:s0:dcp-ws4",),
               doc="the checkpointed state keeps the data but not the per-tensor scale"),
    MutantSpec("unflatten_drops_scale", 19, state.UnflattenDropsScaleParam, V.SILENT_MISMATCH,
               ("fp8_tensor:128x64:bf16:ws2:gather:s0:compile",),
               doc="__tensor_unflatten__ takes the per-tensor scale from defaults (torch.compile's path)"),
    MutantSpec("no_reshard_stale_layout", 20, state.NoReshardStaleLayoutParam, V.SILENT_MISMATCH,
               ("fp8_tensor:128x64:bf16:ws2:steps:s0:raf-no", "fp8_tensor_e5m2:128x64:bf16:ws2:steps:s0:raf-no"),
               doc="without reshard after forward, the out= re-gather keeps the first gather's layout and scales"),
    MutantSpec("empty_shard_stale_scale", 21, state.EmptyShardStaleScaleParam, V.RANK_DIVERGENCE,
               ("fp8_tensor:1x16:bf16:ws3:gather:s0:dcp-ws1", "fp8_tensor_e5m2:1x16:bf16:ws3:gather:s0:dcp-ws1"),
               also=frozenset({V.SILENT_MISMATCH}),
               doc="a rank without rows gathers with its own per-tensor scale, which a checkpoint load never wrote"),
    MutantSpec("shared_scale_cache", 22, state.SharedScaleCacheParam, V.SILENT_MISMATCH,
               ("fp8_tensor:17x64:bf16:ws2:layers:s0",),
               formats=("fp8_tensor", "fp8_tensor_e5m2", "nvfp4_1d", "nvfp4_2d"),
               doc="the per-tensor scale cached once per parameter class, not per weight"),
    MutantSpec("kept_out_scale", 23, state.KeptOutScaleParam, V.SILENT_MISMATCH,
               ("fp8_tensor:128x64:bf16:ws2:gather:s0:compile", "fp8_tensor_e5m2:128x64:bf16:ws2:gather:s0:compile"),
               formats=("fp8_tensor", "fp8_tensor_e5m2"),
               doc="the out= re-gather of a weight FSDP2 keeps after forward stores the scale as scale_inv"),
    MutantSpec("amax_over_dp_only", 24, state.AmaxGroupFromHookParam, V.SILENT_MISMATCH,
               ("fp8_tensor:128x64:bf16:ws4:steps:s0:tp-2x2", "nvfp4_2d:128x64:bf16:ws4:steps:s0:tp-2x2-row",
                "fp8_tensor_e5m2:128x64:bf16:ws4:steps:s0:tp-2x2", "nvfp4_1d:128x64:bf16:ws4:steps:s0:tp-2x2-row"),
               also=frozenset({V.RANK_DIVERGENCE}), adapter=state.AmaxOverShardMeshStep,
               formats=("fp8_tensor", "fp8_tensor_e5m2", "nvfp4_1d", "nvfp4_2d"),
               doc="the per-tensor amax of a step reduced over FSDP2's shard mesh: under tensor parallelism dp only, "
                   "not tp"),
    MutantSpec("staged_wire", 25, group.StagedWireParam, V.SILENT_MISMATCH,
               ("fp8_tensor:17x64:bf16:ws2:block:s0",), also=frozenset({V.ERROR, V.RANK_DIVERGENCE}),
               doc="the pre-hook stages its all-gather inputs in one buffer per class: the group's next pre-hook "
                   "overwrites them before the copy-in"),
    MutantSpec("class_wire_plan", 26, group.ClassWirePlanParam, V.ERROR,
               ("fp8_block:255x64:bf16:ws2:block:s0",), also=frozenset({V.SILENT_MISMATCH, V.RANK_DIVERGENCE}),
               doc="the post-hook reads its outputs with the count and dtypes of its class's last pre-hook's inputs"),
)
