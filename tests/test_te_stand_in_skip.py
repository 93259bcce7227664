"""Which TE NVFP4 cases qgather can build below sm_100 (no GPU needed): the reference-bits stand-in
holds only shards its format holds, so a case with any other shard is SKIPPED with the shard named,
never run into an error charged to TE; a checkpoint's training forward on a weight te.Linear's FP8
forward refuses is skipped with TE's rule; and torchao's compiled layer, whose torch._scaled_mm needs
dims that are multiples of 16 on CUDA, is skipped there for such weights."""

from __future__ import annotations

import pytest
import torch

from qgather.impls import get_impl
from qgather.impls.te import adapter
from qgather.impls.te.route import fp8_forward_refusal
from qgather.model.case import CaseSpec


@pytest.fixture
def te(monkeypatch):
    monkeypatch.setattr(adapter, "sm_name", lambda: "sm_90")
    return get_impl("te")


@pytest.mark.parametrize(("case_id", "shard"), [
    ("te:nvfp4_2d:2x16:bf16:ws8:gather:s0", "rank 0's (1, 16) shard at world size 8"),
    ("te:nvfp4_2d:46x64:bf16:ws2:gather:s0", "rank 0's (23, 64) shard at world size 2"),
    ("te:nvfp4_2d:128x16:bf16:ws4:gather:s0:tp-2x2-row", "rank 0's (64, 8) shard at world size 4"),
])
def test_a_shard_the_stand_in_cannot_hold_is_skipped_with_its_shape(te, case_id, shard):
    reason = te._nvfp4_stand_in_skip(CaseSpec.parse(case_id))
    assert reason is not None and shard in reason and "sm_90" in reason, reason


def test_the_saving_world_size_of_a_checkpoint_counts_too(te):
    # 2 rows per rank where it loads (3 ranks), 3 where it was saved (2 ranks)
    reason = te._nvfp4_stand_in_skip(CaseSpec.parse("te:nvfp4_2d:6x64:bf16:ws3:gather:s0:dcp-ws2"))
    assert reason is not None and "(3, 64) shard at world size 2" in reason


@pytest.mark.parametrize("case_id", ["te:nvfp4_2d:64x64:bf16:ws2:gather:s0", "te:nvfp4_2d:4x64:bf16:ws3:gather:s0",
                                     "te:nvfp4_2d:128x64:bf16:ws4:gather:s0:tp-2x2"])
def test_shards_the_stand_in_holds_run(te, case_id):
    assert te._nvfp4_stand_in_skip(CaseSpec.parse(case_id)) is None


@pytest.mark.parametrize("impl", ["te", "te:delayed"])
def test_a_training_forward_te_refuses_skips_the_trained_checkpoint_case(impl):
    """te:delayed:fp8_tensor:6x16:bf16:ws3:gather:s0:dcp-ws2-trained raised TE's ValueError in the save's
    training forward on 2 x H200 (dims=[6, 16]): te.Linear cannot run that weight in FP8 at all."""
    spec = CaseSpec.parse(f"{impl}:fp8_tensor:6x16:bf16:ws3:gather:s0:dcp-ws2-trained")
    reason = get_impl(impl).config_skip_reason(spec)
    assert reason is not None and "training forward" in reason and "6x16 weight" in reason, reason


@pytest.mark.parametrize(("case_id", "refused"), [
    ("te:fp8_block:511x16:bf16:ws4:gather:s0:dcp-ws2-trained", "511x16"),
    ("te:fp8_tensor:128x40:bf16:ws2:gather:s0", "128x40"),
    ("te:fp8_tensor:12x64:bf16:ws4:gather:s0:tp-2x2", "6x64"),  # column TP: the piece's rows
    ("te:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2", None),
    ("te:fp8_block:768x16:bf16:ws3:gather:s0", None),
])
def test_te_fp8_forward_rule_reads_the_weight_the_forward_receives(case_id, refused):
    reason = fp8_forward_refusal(CaseSpec.parse(case_id))
    assert (reason is None) if refused is None else (f"{refused} weight" in (reason or "")), reason


def test_torchao_compiled_layer_is_skipped_on_cuda_where_scaled_mm_cannot_multiply():
    torchao = get_impl("torchao")
    odd = CaseSpec.parse("torchao:fp8_tensor:1x16:bf16:ws1:gather:s0:compile+dcp-ws2")
    even = CaseSpec.parse("torchao:fp8_tensor:32x16:bf16:ws1:gather:s0:compile+dcp-ws2")
    assert "torch._scaled_mm" in (torchao.skip_reason(odd, torch.device("cuda")) or "")
    assert torchao.skip_reason(even, torch.device("cuda")) is None
    assert torchao.skip_reason(odd, torch.device("cpu")) is None  # the CPU emulates the GEMM
