"""What each TransformerEngine script of docs/repro/ printed on GPUs (the commands of `docs/repro/run-gpu.sh`),
by finding name: quoted verbatim in its upstream draft's "GPU output" section (qgather.tools.standalone.
findings merges it into FINDINGS). A script changed since its run says so after the quote."""

from __future__ import annotations

__all__ = ["GPU_OUTPUT"]

#: What each TE script printed on GPUs, quoted in its draft.
GPU_OUTPUT: dict[str, str] = {
    "te-fp8-block-tile-split": (
        "`torchrun --nproc-per-node 2 docs/repro/te-fp8-block-tile-split.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 25 s, printing\n\n```\n"
        "te:fp8_block:200x256:bf16:ws2:gather:s0: SILENT_MISMATCH - ranks 0, 1: unshard 1: rowwise_data: "
        "32768 of 51200 valid elements differ; rowwise_scale_inv: 2 of 4 valid elements differ; dequantized "
        "weight: 7265 elements differ, max |diff| 11.8; rows 0-127\n```"
    ),
    "te-fp8-tensor-uneven-shards": (
        "`torchrun --nproc-per-node 2 docs/repro/te-fp8-tensor-uneven-shards.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 24 s, printing\n\n```\n"
        "te:fp8_tensor:31x128:bf16:ws2:gather:s0: ERROR - rank 1: AssertionError: When a parameter is "
        "unevenly sharded by FSDP (orig size=torch.Size([31, 128]), FSDP world size=2), fsdp_pre_all_gather "
        "must return all-gather inputs with the padded sharded size torch.Size([16, 128]) but got "
        "[torch.Size([15, 128])]\n```"
    ),
    "te-fp8-block-uneven-sizes": (
        "`torchrun --nproc-per-node 2 docs/repro/te-fp8-block-uneven-sizes.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 47 s, printing\n\n```\n"
        "te:fp8_block:255x128:bf16:ws2:gather:s0: HANG - rank 1: no result within 30 s (REPRO_TIMEOUT_S)\n```"
    ),
    "te-current-scaling-own-amax": (
        "`torchrun --nproc-per-node 2 docs/repro/te-current-scaling-own-amax.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 25 s, printing\n\n```\n"
        "te:fp8_tensor:128x64:bf16:ws2:steps:s0: RANK_DIVERGENCE - rank 0: unshard 1: data: 4096 of 8192 "
        "valid elements differ; scale_inv: 1 of 1 valid elements differ; dequantized weight: 8192 elements "
        "differ, max |diff| 143; rows 0-127\n  rank 1: unshard 1: data: 4096 of 8192 valid elements differ; "
        "dequantized weight: 4096 elements differ, max |diff| 143; rows 0-63\n```"
    ),
    "te-shard-dim1-copy-out": (
        "`torchrun --nproc-per-node 2 docs/repro/te-shard-dim1-copy-out.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 24 s, printing\n\n```\n"
        "te:fp8_block:1024x256:bf16:ws2:gather:s0:dim1: ERROR - rank 1: RuntimeError: shape '[2048, 128]' is "
        "invalid for input of size 64\nte:fp8_block:1024x256:bf16:ws2:gather:s0:dim1: ERROR - rank 0: "
        "RuntimeError: shape '[2048, 128]' is invalid for input of size 64\n```"
    ),
    "te-blockwise-cannot-dequantize": (
        "`torchrun --nproc-per-node 2 docs/repro/te-blockwise-cannot-dequantize.py` on 4 x H200 (sm_90), "
        "torch 2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, "
        "all fifteen at once on one host): exit 1 after 24 s, printing\n\n```\n"
        "te:fp8_block:4x64:bf16:ws2:gather:s0: ERROR - rank 0: RuntimeError: shape '[2, 128, 1, 128]' is "
        "invalid for input of size 16384\nte:fp8_block:4x64:bf16:ws2:gather:s0: ERROR - rank 1: RuntimeError: "
        "shape '[2, 128, 1, 128]' is invalid for input of size 16384\n```"
    ),
    "te-tp-amax": (
        "`torchrun --nproc-per-node 2 docs/repro/te-tp-amax.py` on 4 x H200 (sm_90), torch 2.11.0+cu130, "
        "TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all fifteen at once "
        "on one host): exit 1 after 25 s, printing\n\n```\nte:fp8_tensor:128x64:fp32:ws2:reshard:s0:tp-1x2: "
        "SILENT_MISMATCH - rank 0: unshard 1: tp rank 0 of 2: data: 4096 of 4096 valid elements differ; "
        "scale_inv: 1 of 1 valid elements differ; dequantized weight: 4096 elements differ, max |diff| 0.141;"
        " rows 0-63\n```"
    ),
    "te_fp8_block_flat_view_copy": (
        "`torchrun --nproc-per-node 2 docs/repro/te_fp8_block_flat_view_copy.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 27 s, printing\n\n```\nDEFECT: FSDP2 keeps a dequantized "
        "copy of the Float8BlockwiseQTensor shard\n```"
    ),
    "te-world-size-1-post-hooks": (
        "`torchrun --nproc-per-node 1 docs/repro/te-world-size-1-post-hooks.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 17 s, printing\n\n```\n"
        "te:fp8_block:1024x64:bf16:ws1:gather:s0: ERROR - rank 0: ValueError: not enough values to unpack "
        "(expected 2, got 1)\n```"
    ),
    "te-blockwise-single-row": (
        "`torchrun --nproc-per-node 1 docs/repro/te-blockwise-single-row.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 18 s, printing\n\n```\n"
        "te:fp8_block:1x512:bf16:ws1:gather:s0: ERROR - rank 0: IndexError: list index out of range\n```"
    ),
    "te-delayed-dcp-extra-state": (
        "`torchrun --nproc-per-node 4 docs/repro/te-delayed-dcp-extra-state.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 24 s, printing\n\n```\n"
        "te:delayed:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2-trained: ERROR - rank 3: "
        "CheckpointException: CheckpointException ranks:dict_keys([0, 1, 2, 3])\n"
        "te:delayed:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2-trained: ERROR - rank 0: "
        "CheckpointException: CheckpointException ranks:dict_keys([0, 1, 2, 3])\n"
        "te:delayed:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2-trained: ERROR - rank 2: "
        "CheckpointException: CheckpointException ranks:dict_keys([0, 1, 2, 3])\n"
        "te:delayed:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2-trained: ERROR - rank 1: "
        "CheckpointException: CheckpointException ranks:dict_keys([0, 1, 2, 3])\n```\n\nAn earlier run (2 x "
        "H200, the same day) said HANG: the script's own, not TE's. Its saving ranks (0 and 1 of the 4 it "
        "launches) ran the training forward under `te.autocast` with the default `amax_reduction_group`, the "
        "whole launched world, so DelayedScaling's amax all-reduce at the autocast's exit waited for ranks 2 "
        "and 3 in the script's barrier. The script now hands the autocast the saving ranks' group and gives "
        "ERROR on every rank, as qgather's case does."
    ),
    "te-blockwise-checkpoint-tile-split": (
        "`torchrun --nproc-per-node 3 docs/repro/te-blockwise-checkpoint-tile-split.py` on 4 x H200 (sm_90), "
        "torch 2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, "
        "all fifteen at once on one host): exit 1 after 23 s, printing\n\n```\n"
        "te:fp8_block:1024x64:bf16:ws2:gather:s0:dcp-ws3: SILENT_MISMATCH - ranks 0, 1: unshard 1: "
        "rowwise_data: 64644 of 65536 valid elements differ; rowwise_scale_inv: 8 of 8 valid elements differ;"
        " dequantized weight: 65113 elements differ, max |diff| 848; rows 0-1023\n```"
    ),
    "te-blockwise-checkpoint-trained": (
        "`CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node 4 docs/repro/te-blockwise-checkpoint-trained.py` on "
        "4 x H200 (sm_90; the 4 ranks on one GPU, gloo), torch 2.11.0+cu130, TransformerEngine 2.20.2, "
        "2026-11-28, late: exit 1 after 20 s, printing\n\n```\n"
        "te:fp8_block:1024x64:bf16:ws4:gather:s0:dcp-ws2-trained: SILENT_MISMATCH - ranks 0, 1, 2, 3: unshard 1: "
        "rowwise_data: 8192 of 65536 valid elements differ; rowwise_scale_inv: 1 of 8 valid elements differ\n```\n\n"
        "An earlier run (all fifteen scripts at once, the same day) ended in the script's own IndexError: its "
        "evidence line indexed the rows whose dequantized values differ when there were none. The evidence "
        "piece now names the differing buffers, as qgather's report does."
    ),
    "te_refused_autocast_leaves_fp8_enabled": (
        "`python3 docs/repro/te_refused_autocast_leaves_fp8_enabled.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 13 s, printing\n\n```\nDEFECT: the refused autocast left "
        "TE's FP8 state enabled\n```"
    ),
    "te_delayed_fused_adam_stale_transpose": (
        "`python3 docs/repro/te_delayed_fused_adam_stale_transpose.py` on 4 x H200 (sm_90), torch "
        "2.11.0+cu130, TransformerEngine 2.20.2, 2026-11-28 (the commands of `docs/repro/run-gpu.sh`, all "
        "fifteen at once on one host): exit 1 after 11 s, printing\n\n```\nDEFECT: the backward's FP8 transpose "
        "is stale after FusedAdam's step\n```"
    ),
}
