"""The findings of docs/findings.md that ship a standalone script: `FINDINGS`, one record each, from
which `python -m qgather.tools.standalone` writes docs/repro/<name>.py (the script) and
docs/upstream/<name>.md (a draft issue for the library's tracker, the script inside).

Each record says what the draft says: the versions seen, what should happen, what happens (the
script's own output where it runs on the CPU, else qgather's report from the GPU run the finding
cites), the library's lines that cause it and a suggested fix."""

from __future__ import annotations

from dataclasses import dataclass, replace

from qgather.tools.standalone.gpu_output import GPU_OUTPUT

__all__ = ["FINDINGS", "Finding"]

TORCHAO = "torch 2.13.0 (CPU), torchao 0.18.0; python 3.11"
TE = "torch 2.11.0+cu130, TransformerEngine 2.20.2, 2 x H200 (sm_90)"
TE_ONE_GPU = "torch 2.11.0+cu130, TransformerEngine 2.20.2, one H200 (sm_90; 2 ranks as gloo on CUDA)"


@dataclass(frozen=True)
class Finding:
    """One finding's script and draft.

    Args:
        name: the files' name, docs/repro/<name>.py and docs/upstream/<name>.md.
        case_id: the qgather case the script reproduces.
        title: the draft's title (the finding, as the library's maintainers would file it).
        anchor: the finding's anchor in docs/findings.md.
        library: the project the draft is for.
        versions: what it was seen on.
        expected, actual, cause, fix: the draft's sections (Markdown).
        gpu_output: what the script printed on GPUs, quoted by whoever ran `docs/repro/run-gpu.sh`
            ("": not yet run; TE's scripts need GPUs).
        probe: the script is pieces of no case: qgather/tools/standalone/probes/<name>.py, copied
            (case_id then names the case closest to it, or "").
        ranks: the probe's process count (1: `python FILE`; more: torchrun).
    """

    name: str
    case_id: str
    title: str
    anchor: str
    library: str
    versions: str
    expected: str
    actual: str
    cause: str
    fix: str
    gpu_output: str = ""
    probe: bool = False
    ranks: int = 1


FINDINGS: tuple[Finding, ...] = (
    Finding(
        "torchao-tp-amax", "torchao:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2",
        "float8 FSDP2 + tensor parallel: each TP piece is cast with its own amax", "torchao-tp-amax",
        "torchao", TORCHAO,
        expected="Every rank's gathered TP piece equals its rows of the single-device tensorwise float8 cast "
                 "of the whole weight (one amax), as it does with `precompute_float8_dynamic_scale_for_fsdp`.",
        actual="```\ntorchao:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2: SILENT_MISMATCH - ranks 0, 2: tp rank 0 "
               "of 2: rows [0, 64): data: 4096 of 4096 valid elements differ; scale_inv: 1 of 1 valid elements "
               "differ; dequantized weight: 4096 elements differ, max |diff| 0.143; rows 0-63\n```\n"
               "No error: the piece that does not hold the weight's largest value is cast with its own, smaller "
               "amax.",
        cause="`WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather(self, mesh)` "
              "(torchao/float8/fsdp_utils.py:228-251) casts with `reduce_amax=True, device_mesh=mesh`, and "
              "`tensor_to_amax` (torchao/float8/float8_utils.py:75) all-reduces over `device_mesh.get_group()`. "
              "The mesh FSDP2 hands the hook is its shard mesh, \"dp\" only, so the amax is never reduced over "
              "\"tp\". test/float8/test_fsdp2_tp.py checks no numerics (\"TODO(future PR): test numerics\").",
        fix="Reduce the amax over every mesh dimension the weight is split on: when the wrapped tensor is "
            "a DTensor shard of a TP-distributed weight, all-reduce over its full mesh (as "
            "`precompute_float8_dynamic_scale_for_fsdp` does through a `Partial(max)` DTensor)."),
    Finding(
        "torchao-uneven-shards", "torchao:fp8_tensor:5x64:bf16:ws2:gather:s0",
        "float8 FSDP2 all-gather: uneven shards send fewer bytes from the short rank", "torchao-uneven-shards",
        "torchao", TORCHAO,
        expected="A 5-row weight on 2 ranks (3 + 2 rows) gathers to the single-device cast, or is refused on "
                 "every rank with an error that names the constraint.",
        actual="```\ntorchao:fp8_tensor:5x64:bf16:ws2:gather:s0: CRASH - rank 1 killed by SIGABRT\n"
               "  rank 0: RuntimeError: [.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:...: "
               "Connection reset by peer. ...\n```\n"
               "gloo aborts (`op.preamble.length <= op.nbytes. 96 vs 64`); on NCCL the short rank raises "
               "`setStorage ... out of bounds` (seen on 2 x H200).",
        cause="`fsdp_pre_all_gather(self, mesh)` (torchao/float8/fsdp_utils.py:228) has FSDP2's one-argument "
              "signature and returns `(float8_training_tensor._data,)` of the rank's own shard (line 251). "
              "FSDP2 checks that every all-gather input has the padded shard size only for the five-argument "
              "hook, so the rank with 2 rows hands the collective 128 bytes while the other hands 192.",
        fix="Take FSDP2's five-argument signature and pad the float8 data to the padded shard size "
            "(FSDP2 then checks it), or refuse uneven shards on every rank before the collective."),
    Finding(
        "torchao-zero-row-shard", "torchao:fp8_tensor:5x64:bf16:ws4:gather:s0",
        "float8 FSDP2 all-gather: a rank with zero rows raises, the others wait", "torchao-uneven-shards",
        "torchao", TORCHAO,
        expected="A 5-row weight on 4 ranks (2, 2, 1 and 0 rows) gathers to the single-device cast: an empty "
                 "shard contributes amax 0 to the all-reduce.",
        actual="```\ntorchao:fp8_tensor:5x64:bf16:ws4:gather:s0: ERROR - rank 3: RuntimeError: max(): Expected "
               "reduction dim to be specified for input.numel() == 0. Specify the reduction dim with the 'dim' "
               "argument.\n```\n(the other ranks then fail with `Connection closed by peer` in the all-reduce).",
        cause="`tensor_to_amax` (torchao/float8/float8_utils.py:65) computes `torch.max(torch.abs(x))`, which "
              "raises for an empty tensor, on the zero-row rank only.",
        fix="`torch.abs(x).amax()` with an empty-tensor guard (amax 0) before the all-reduce, so that every "
            "rank enters it."),
    Finding(
        "torchao-precompute-uneven-hang", "torchao:precompute:fp8_tensor:5x64:bf16:ws2:gather:s0",
        "float8 FSDP2 with precomputed scales: uneven shards hang", "torchao-uneven-shards",
        "torchao", TORCHAO,
        expected="With `precompute_float8_dynamic_scale_for_fsdp` before the all-gather, the 5-row weight on 2 "
                 "ranks gathers to the single-device cast.",
        actual="`HANG`: the script's deadline (REPRO_TIMEOUT_S, 30 s) passes with both ranks waiting. qgather's "
               "report: one rank waits in an amax all-reduce, the other in the all-gather.",
        cause="Not yet located to a line. qgather's evidence: FSDP2 re-wraps the padded shard at lazy "
              "initialization and the precomputed scale is lost on that rank only, which then casts "
              "dynamically and all-reduces its amax (`tensor_to_amax`, torchao/float8/float8_utils.py:75) "
              "while the other rank enters the all-gather.",
        fix="Keep `_precomputed_scale` across the re-wrap (`__tensor_unflatten__` / the padding path), or "
            "compute the dynamic scale on every rank whenever any rank lacks a precomputed one."),
    Finding(
        "te-fp8-block-tile-split", "te:fp8_block:200x256:bf16:ws2:gather:s0",
        "Float8BlockwiseQTensor under FSDP2: shards that split a 128-row tile gather a different weight",
        "te-blockwise-tile-split", "TransformerEngine", TE,
        expected="The gathered weight equals the single-GPU Float8BlockScaling quantization of the full "
                 "200x256 weight, or every rank refuses the 100-row shards (not a multiple of 128), as "
                 "NVFP4's pre-hook refuses shards off its 16-row blocks.",
        actual="qgather's report of the same case (2 x H200): `SILENT_MISMATCH` - `rowwise_data: 32768 of "
               "51200 valid elements differ; rowwise_scale_inv: 2 of 4 valid elements differ`, dequantized "
               "weight 7265 elements differ (max |diff| 11.8), from block row 0. The script prints the same "
               "evidence (its run on GPUs: docs/gpu-results.md).",
        cause="`reset_parameters` quantizes each rank's shard on its own 128x128 tile grid, and "
              "`Float8BlockwiseQTensor.fsdp_pre_all_gather` "
              "(transformer_engine/pytorch/tensor/float8_blockwise_tensor.py:603-662) gathers the shards "
              "without checking that each starts on a tile boundary (NVFP4's pre-hook checks its 16-row "
              "blocks, nvfp4_tensor.py:597-602): the tile that straddles rows 0-127 gets rank 0's 100 rows "
              "and rank 1's first 28 rows quantized separately.",
        fix="Refuse, in the pre-hook on every rank, a shard whose first row is not a multiple of 128 "
            "(naming the constraint), as the NVFP4 hook does for 16."),
    Finding(
        "te-fp8-tensor-uneven-shards", "te:fp8_tensor:31x128:bf16:ws2:gather:s0",
        "Float8Tensor under FSDP2: uneven shards raise on the padded ranks only",
        "te-fp8-tensor-uneven-shards", "TransformerEngine", TE,
        expected="A 31-row weight on 2 ranks (16 + 15 rows) gathers to the single-GPU Float8CurrentScaling "
                 "quantization, or every rank refuses it before the collective.",
        actual="qgather's report (2 x H200): `ERROR` - the rank with padding raises FSDP2's padded-size check "
               "while the other enters the all-gather and waits (under torchrun the script prints that rank's "
               "error and torchrun stops the other).",
        cause="`Float8Tensor.fsdp_pre_all_gather` returns the shard's own `(self._data,)` whatever its size; "
              "FSDP2 requires every input at the padded shard size and checks it only on the ranks that have "
              "padding.",
        fix="Pad `_data` to the padded shard size in the pre-hook (FSDP2 hands the hook the sizes), or "
            "refuse uneven shards on every rank."),
    Finding(
        "te-fp8-block-uneven-sizes", "te:fp8_block:255x128:bf16:ws2:gather:s0",
        "Float8BlockwiseQTensor under FSDP2: uneven shards hand the collective different sizes",
        "te-blockwise-uneven-sizes", "TransformerEngine", TE,
        expected="A 255-row weight on 2 ranks gathers to the single-GPU quantization, or every rank refuses "
                 "it before the collective.",
        actual="qgather's report (2 x H200, NCCL): `HANG` - rank 0 (128 rows) handed the all-gather "
               "`uint8[128, 128], float32[1, 4]` = 16400 bytes, rank 1 (127 rows) 32768 bytes. The script "
               "reports HANG at its own deadline, REPRO_TIMEOUT_S (NCCL's watchdog had not ended the ranks "
               "75 s after a 30 s process-group timeout on 2 x H200).",
        cause="FSDP2's padded-size check does not fire for the blockwise pre-hook's inputs "
              "(float8_blockwise_tensor.py:603-662), and the short rank's buffers are not padded.",
        fix="Pad every all-gather input to the padded shard's size, or refuse uneven shards on every rank."),
    Finding(
        "te-world-size-1-post-hooks", "te:fp8_block:1024x64:bf16:ws1:gather:s0",
        "FSDP2 at world size 1 breaks the blockwise and NVFP4 post-all-gather hooks",
        "te-world-size-1-post-hooks", "TransformerEngine", TE,
        expected="A single-GPU FSDP2 run (world size 1) of Float8BlockScaling gathers its weight as at 2 ranks.",
        actual="qgather's report (H200): `ERROR` on the first unshard, `ValueError: not enough values to unpack "
               "(expected 2, got 1)` in the post-all-gather hook.",
        cause="At world size 1 FSDP2 hands `fsdp_post_all_gather` only `all_gather_inputs[0]` "
              "(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py); TE's post-hooks unpack two "
              "(`rowwise_data, rowwise_scale_inv = all_gather_outputs[:2]`, float8_blockwise_tensor.py:686, "
              "nvfp4_tensor.py:667, mxfp8_tensor.py:708).",
        fix="Pack every buffer into the first input at world size 1 (qgather's reference subclass does), or "
            "have FSDP2 pass every input (a torch fix)."),
    Finding(
        "te-current-scaling-own-amax", "te:fp8_tensor:128x64:bf16:ws2:steps:s0",
        "Float8Tensor under FSDP2: a shard re-quantized before the first all-gather keeps its own amax",
        "te-current-scaling-own-amax", "TransformerEngine", TE_ONE_GPU,
        expected="Re-quantizing each shard from its own, unchanged rows before the first all-gather (an optimizer "
                 "step, or a checkpoint loaded with `copy_` before the first forward) leaves every rank's gathered "
                 "weight equal to the single-GPU Float8CurrentScaling quantization: one amax, the whole weight's.",
        actual="qgather's report (one H200, 2 ranks as gloo on CUDA): `RANK_DIVERGENCE` at the first unshard - "
               "`rank 0: data: 4096 of 8192 valid elements differ; scale_inv: 1 of 1 valid elements differ; "
               "dequantized weight: 8192 elements differ, max |diff| 143`, the differing rows exactly rank 0's "
               "(0-63). No error. After the first all-gather the same `quantize_` is exact.",
        cause="Not yet located to a line. TE hands a sharded `Float8Tensor` its amax reduction group in "
              "`fsdp_pre_all_gather`; a `quantize_` into the local shard before the first all-gather finds no "
              "group, so current scaling takes each shard's own amax, and each rank then gathers every rank's "
              "bytes under its own scale.",
        fix="Give the weight's quantizer its amax reduction group when the parameter is sharded (at "
            "`reset_parameters` under FSDP2), not in the first pre-hook."),
    Finding(
        "te-shard-dim1-copy-out", "te:fp8_block:1024x256:bf16:ws2:gather:s0:dim1",
        "Float8BlockwiseQTensor under FSDP2 Shard(1): the all-gather copy-out fails on every rank",
        "te-shard-dim1-copy-out", "TransformerEngine", TE_ONE_GPU,
        expected="With `shard_placement_fn` returning `Shard(1)`, the gathered weight equals the single-GPU "
                 "Float8BlockScaling quantization, or TE refuses the placement with an error that names it.",
        actual="qgather's report (one H200, 2 ranks as gloo on CUDA): `ERROR` on every rank in FSDP2's "
               "`foreach_all_gather_copy_out` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:439, "
               "torch 2.11): `RuntimeError: shape '[2048, 128]' is invalid for input of size 64`, although every "
               "dim-1 shard starts on a 128-column tile. Float8CurrentScaling "
               "(`te:fp8_tensor:128x64:bf16:ws2:gather:s0:dim1`) gathers exactly.",
        cause="FSDP2 views each all-gather output in the parameter's dim-1 layout; "
              "`Float8BlockwiseQTensor.fsdp_pre_all_gather` (float8_blockwise_tensor.py:603-662) hands it scale "
              "buffers laid out for dim-0 shards without looking at the placement (NVFP4's pre-hook likewise).",
        fix="Refuse a non-zero shard dim in the pre-hook with an error that names it, or lay the scales out for "
            "the shard dim."),
    Finding(
        "te-blockwise-single-row", "te:fp8_block:1x512:bf16:ws1:gather:s0",
        "Float8BlockwiseQTensor under FSDP2: a single-row weight breaks the flat view FSDP2 takes of its shard",
        "te-blockwise-single-row", "TransformerEngine", TE_ONE_GPU,
        expected="A one-row weight (1 x 512) under FSDP2 is sharded and gathered to its single-GPU "
                 "Float8BlockScaling quantization, as a weight of many rows is.",
        actual="qgather's report (one H200): `ERROR` while FSDP2 shards the parameter: `IndexError: list index out "
               "of range`, at 1 and 2 ranks, bf16 and fp32.",
        cause="FSDP2 views each local shard as one flat dimension. `_ViewFunc.forward` "
              "(float8_blockwise_tensor.py:787-788) tests `shape[-1] != ctx.shape[-1] or shape[-2] != "
              "ctx.shape[-2]`; for a flat target the first test is normally true (TE then warns and dequantizes), "
              "but for 1 x K viewed as (K,) it is false and `shape[-2]` raises.",
        fix="Test `len(shape)` before indexing `shape[-2]`: a view to fewer dimensions takes the "
            "warn-and-dequantize path as any other flat view does."),
    Finding(
        "te-blockwise-cannot-dequantize", "te:fp8_block:4x64:bf16:ws2:gather:s0",
        "Float8BlockwiseQTensor under FSDP2: shards smaller than a tile gather a weight TE cannot dequantize",
        "te-blockwise-cannot-dequantize", "TransformerEngine", TE_ONE_GPU,
        expected="A 4-row weight on 2 ranks (2 rows each) gathers to the single-GPU Float8BlockScaling "
                 "quantization, which TE's own `dequantize()` reads, or every rank refuses the shards.",
        actual="qgather's report (one H200, 2 ranks as gloo on CUDA): `ERROR` on every rank in TE's "
               "`dequantize()` of the gathered weight: `RuntimeError: shape '[2, 128, 1, 128]' is invalid for "
               "input of size 16384` (float8_blockwise_tensor_storage.py:85); in the model scenario "
               "(`te:fp8_block:128x352:bf16:ws2:model:s0`) TE's forward raises the same.",
        cause="Each rank quantizes its 2-row shard on its own 128x128 tile grid (the tile-split finding); the "
              "post-hook concatenates the shards' padded tiles, so the gathered data holds two tiles' worth of "
              "rows for a weight of one tile, which `dequantize()` cannot reshape.",
        fix="Refuse, in the pre-hook on every rank, a shard that does not start on a 128-row tile boundary "
            "(as for the tile split), or gather unpadded rows."),
    Finding(
        "te-delayed-dcp-extra-state", "te:delayed:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2-trained",
        "DelayedScaling: a DCP checkpoint saved after training does not load into a freshly built module",
        "te-delayed-dcp-extra-state", "TransformerEngine", TE_ONE_GPU,
        expected="A te.Linear (DelayedScaling, TE's FSDP2 route) saved with torch.distributed.checkpoint after "
                 "one training forward at 2 ranks loads into a freshly built module at 4 ranks, as it does when "
                 "saved before any forward.",
        actual="qgather's report (one H200, gloo on CUDA): `ERROR` in the load on every rank: `ValueError: Size "
               "mismatch between saved torch.Size([22322]) and current: torch.Size([0]) for _extra_state` "
               "(wrapped in DCP's `CheckpointException`, a BaseException: the script reports it as the rank's "
               "error). A one-GPU probe printed `DelayedScaling: _extra_state bytes: fresh 0, after one forward "
               "22322, another fresh module 0`; Float8CurrentScaling: 0 bytes before and after, and it loads.",
        cause="A te.Linear's `_extra_state` is empty until its first forward under `te.autocast` "
              "(module/base.py:1387: `fp8_checkpoint = fp8_meta[\"fp8_checkpoint\"] or self.fp8 or "
              "self.fp8_calibration`), then holds DelayedScaling's scales and amax history, so the saved and "
              "the fresh state dicts disagree on its size, which DCP's load planner refuses.",
        fix="Give `_extra_state` the same size before the first forward (the recipe's empty history), or "
            "accept a size change in the load (`set_extra_state` already accepts any size outside DCP)."),
    Finding(
        "te-blockwise-checkpoint-tile-split", "te:fp8_block:1024x64:bf16:ws2:gather:s0:dcp-ws3",
        "Float8BlockwiseQTensor: a checkpoint saved at a tile-splitting world size loads wrong values",
        "te-blockwise-checkpoint-tile-split", "TransformerEngine", TE_ONE_GPU,
        expected="A 1024-row weight saved with torch.distributed.checkpoint at 3 ranks (342-row shards) and loaded "
                 "at 2 ranks (512-row shards, tile-aligned) gathers to the single-GPU Float8BlockScaling "
                 "quantization, or the save refuses the tile-splitting shards.",
        actual="qgather's report (one H200, gloo on CUDA), twice: `SILENT_MISMATCH` - `rowwise_data: 64644 of 65536 "
               "valid elements differ; rowwise_scale_inv: 8 of 8`, dequantized weight 65113 elements differ, max "
               "|diff| 848, in every block row from both ranks. Saved at 2 ranks (`...:dcp-ws2`): EXACT.",
        cause="At 3 ranks each shard is quantized on its own 128-row tile grid (the tile-split finding) and DCP "
              "saves those shards without complaint; the load at 2 ranks writes the saved bytes and scales into "
              "another tiling.",
        fix="Refuse tile-splitting shards in the pre-hook and at `reset_parameters` (then nothing is saved "
            "from them), or save the high-precision shard and re-quantize after the load."),
    Finding(
        "te-blockwise-checkpoint-trained", "te:fp8_block:1024x64:bf16:ws4:gather:s0:dcp-ws2-trained",
        "Float8BlockwiseQTensor: a checkpoint saved after a training forward loads one tile wrong",
        "te-blockwise-checkpoint-trained", "TransformerEngine", TE_ONE_GPU,
        expected="A weight saved at 2 ranks after one forward under `te.autocast` and loaded at 4 ranks into a "
                 "freshly built module gathers to the single-GPU Float8BlockScaling quantization, as it does "
                 "when saved as built.",
        actual="qgather's report (one H200, gloo on CUDA), three runs alike: `SILENT_MISMATCH` - `rowwise_data: "
               "8192 of 65536 valid elements differ; rowwise_scale_inv: 1 of 8`, block row 3 (rows 384-511, the "
               "saving rank 0's last tile), loaded by rank 1. Saved as built (`...:dcp-ws2`): EXACT.",
        cause="Not yet located. What the forward changes in the sharded Float8BlockwiseQTensor that DCP then "
              "saves is the open question (its columnwise usage is the first suspect).",
        fix="Not yet known; the script shows the one wrong tile."),
    Finding(
        "te-tp-amax", "te:fp8_tensor:128x64:fp32:ws2:reshard:s0:tp-1x2",
        "te.Linear with tp_group under FSDP2: each TP piece quantized with the amax of its dp shards only",
        "te-tp-amax", "TransformerEngine", "torch 2.11.0+cu130, TransformerEngine 2.20.2, one H100 (sm_90)",
        expected="te.Linear(tp_group=..., tp_size=2, parallel_mode=\"column\") built on meta under "
                 "`quantized_model_init(Float8CurrentScaling)`, `fully_shard(mesh=mesh[\"dp\"])`, "
                 "`reset_parameters()`: every TP rank's gathered piece equals its rows of the single-GPU "
                 "quantization of the whole weight (one amax).",
        actual="qgather's report (one H100, ranks as gloo on the GPU): `SILENT_MISMATCH` - `unshard 1: tp rank 0 "
               "of 4: rows [0, 32): data: 2048 of 2048 valid elements differ; scale_inv: 1 of 1 valid elements "
               "differ` (`te:fp8_tensor:128x64:bf16:ws8:reshard:s0:tp-2x4`); the same class at tp-1x2.",
        cause="TE takes the quantizer's `amax_reduction_group` from the parameter's FSDP mesh, \"dp\" only: "
              "each TP piece is scaled by the amax of its own dp shards, never reduced over \"tp\".",
        fix="Reduce the weight's amax over the tensor-parallel group too (the module has it: `tp_group`) "
            "when the recipe scales per tensor."),
    Finding(
        "te_refused_autocast_leaves_fp8_enabled", "",
        "A refused te.autocast leaves TE's global FP8 state enabled for the rest of the process",
        "te-refused-autocast", "TransformerEngine", "torch 2.11.0+cu130, TransformerEngine 2.20.2, one H200 (sm_90)",
        expected="A `te.autocast` whose recipe the GPU cannot run raises and leaves TE's global FP8 state as it "
                 "found it.",
        actual="On an H200: `before: FP8 enabled = False`; `te.autocast(NVFP4BlockScaling) refused: Device compute "
               "capability 10.0 or higher required for NVFP4 execution.`; `after the refused autocast: FP8 "
               "enabled = True recipe = NVFP4BlockScaling`; `a DelayedScaling te.Linear built afterwards, never "
               "run: fp8 = True _extra_state bytes = 22158`.",
        cause="`FP8GlobalStateManager.autocast_enter` (transformer_engine/pytorch/quantization.py:730-769) first "
              "writes the new state (`fp8_enabled`, the recipe, `autocast_depth += 1`) and only then asserts that "
              "the GPU can run the recipe; `autocast.__enter__` (line 1037) raises, so `__exit__` (line 1056), "
              "which restores the previous state, never runs.",
        fix="Assert before mutating the state, or enter the state inside the `try` whose `finally` restores it.",
        probe=True),
    Finding(
        "te_delayed_fused_adam_stale_transpose", "te:delayed:fp8_tensor:256x512:bf16:ws1:model:s0",
        "DelayedScaling + FusedAdam(master_weights=True): the backward uses a stale FP8 transpose",
        "te-delayed-fused-adam-stale-transpose", "TransformerEngine",
        "torch 2.11.0+cu130, TransformerEngine 2.20.2, one H200 (sm_90)",
        expected="After `te.optimizers.FusedAdam(..., master_weights=True).step()` the Float8Tensor weight's cached "
                 "transpose equals its data's transpose, or is marked invalid.",
        actual="qgather's probe (2 x H200, one GPU used): a 256x256 bf16 te.Linear, lr 1e-2: `after init: "
               "stale_elements=0/65536`, `after step 1: stale_elements=65536/65536 invalid=False`; dgrad with "
               "the held transpose against the same backward after dropping it: `equal=False max|diff|=1.086`.",
        cause="Not yet located in TE's source: which FusedAdam path writes FP8 data under delayed scaling "
              "without invalidating the transpose.",
        fix="Invalidate (or rewrite) the cached transpose wherever FusedAdam writes a Float8Tensor's data.",
        probe=True),
    Finding(
        "te_fp8_block_flat_view_copy", "",
        "Float8BlockwiseQTensor under FSDP2: FSDP2 keeps a dequantized bf16 copy of every shard",
        "te-fp8-block-flat-view-copy", "TransformerEngine", "torch 2.11.0+cu130, TransformerEngine 2.20.2, 4 x H100",
        expected="The sharded Float8BlockwiseQTensor weights take the FP8 shard's memory, as Float8Tensor's do.",
        actual="te.Linear 8192 x 28672, 4 x H100: at 2 ranks the FP8 shard is 224 MiB of buffers, FSDP2's flat "
               "shard a `torch.Tensor` bf16 of 224 MiB, and what stays allocated after a forward and backward "
               "(gradients freed) grows by 224 MiB (Float8CurrentScaling: +0); the first unshard peaks 896 MiB "
               "above the built layer (the control: 448).",
        cause="FSDP2's lazy initialization (`FSDPParam.reset_sharded_param`) stores `local_tensor.view(-1)` as "
              "its flat shard; TE's `_ViewFunc.forward` answers a view of a 2-D-scaled Float8BlockwiseQTensor to "
              "another shape with the dequantized values.",
        fix="TE: a flat `view` of a 2-D-scaled tensor that does not dequantize, or FSDP2: no flat view of a local "
            "tensor whose class has `fsdp_pre_all_gather`.",
        probe=True, ranks=2),
)

FINDINGS = tuple(replace(f, gpu_output=f.gpu_output or GPU_OUTPUT.get(f.name, "")) for f in FINDINGS)
