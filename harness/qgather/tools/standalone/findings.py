"""The findings of docs/findings.md that ship a standalone script: `FINDINGS`, one record each, from
which `python -m qgather.tools.standalone` writes docs/repro/<name>.py (the script) and
docs/upstream/<name>.md (a draft issue for the library's tracker, the script inside).

Each record says what the draft says: the versions seen, what should happen, what happens (the
script's own output where it runs on the CPU, else qgather's report from the GPU run the finding
cites), the library's lines that cause it and a suggested fix."""

from __future__ import annotations

from dataclasses import dataclass

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
        actual="`HANG`: the script's deadline (120 s) passes with both ranks waiting. qgather's report: one "
               "rank waits in an amax all-reduce, the other in the all-gather.",
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
)
