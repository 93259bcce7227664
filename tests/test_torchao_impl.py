"""The torchao adapter (harness/qgather/impls/torchao/adapter.py) on gloo/CPU: what torchao 0.18's float8
all-gather (Float8LinearConfig(enable_fsdp_float8_all_gather=True)) does under FSDP2.

Each expected verdict below is what torchao does, established by running it and reading its code;
the non-EXACT ones document torchao behaviours (root causes in the comments), they are not
tolerances. Line numbers are torchao 0.18.0 and torch 2.13.
"""

import inspect
import re

import pytest
import torch

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao==0.18.0)")

from qgather.engine.run import RunOptions, run_case  # noqa: E402
from qgather.formats import FORMATS  # noqa: E402
from qgather.impls import get_impl  # noqa: E402
from qgather.model.case import CaseSpec  # noqa: E402
from qgather.model.verdict import Verdict  # noqa: E402
from qgather.scenarios.data import make_weight  # noqa: E402

CPU = RunOptions(backend="gloo", device="cpu", case_timeout=30.0)


def _run(case_id):
    return run_case(CaseSpec.parse(case_id), CPU)


# ------------------------------------------------------------------ exact gathers
@pytest.mark.parametrize("case_id", [
    "torchao:fp8_tensor:64x64:bf16:ws1:steps:s0",               # world size 1
    "torchao:fp8_tensor:64x64:bf16:ws2:gather:s0",
    "torchao:fp8_tensor:3x64:bf16:ws3:gather:s0",               # one row per rank
    "torchao:fp8_tensor:8x64:bf16:ws4:steps:s0",                # amax all-reduced in the pre-hook
    "torchao:fp8_tensor:64x64:bf16:ws4:reshard:s0",             # second unshard: the out= path
    "torchao:precompute:fp8_tensor:64x64:bf16:ws2:steps:s0",    # precompute_float8_dynamic_scale_for_fsdp
    "torchao:precompute:fp8_tensor:8x64:bf16:ws4:reshard:s0",
])
def test_even_shards_gather_exactly(case_id):
    report = _run(case_id)
    assert report.verdict is Verdict.EXACT, report.render()


# ------------------------------------------------------------------ fp32 masters
@pytest.mark.parametrize("case_id", [
    "torchao:fp8_tensor:64x64:fp32:ws2:gather:s0",
    "torchao:precompute:fp8_tensor:64x64:fp32:ws4:steps:s0",
])
def test_fp32_masters_gather_exactly(case_id):
    # The layer output applies the scale as torchao's matmul does (data * scale.reciprocal()),
    # which is bit-identical to the golden's data * scale_inv; torchao's to_original_precision()
    # divides instead and differs in the last bit (test_to_original_precision_divides_by_the_scale).
    report = _run(case_id)
    assert report.verdict is Verdict.EXACT, report.render()


# ------------------------------------------------------------------ uneven shards
@pytest.mark.parametrize("case_id", [
    "torchao:fp8_tensor:5x64:bf16:ws2:gather:s0",     # shards of 3 and 2 rows
    "torchao:fp8_tensor:64x64:fp32:ws3:steps:s0",     # 22, 22, 20 rows
])
def test_uneven_shards_crash_the_gather(case_id):
    # WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather(self, mesh) (fsdp_utils.py:228) has
    # FSDP2's legacy one-argument signature and returns the float8 cast of its UNPADDED shard
    # (fsdp_utils.py:251). FSDP2 checks "all-gather inputs have the padded sharded size" only for
    # the five-argument signature (torch/distributed/fsdp/_fully_shard/_fsdp_param.py:856-891), so
    # the short rank hands the collective fewer bytes than the others: gloo aborts that rank
    # ("Received data size doesn't match expected size", SIGABRT; once in CI a rank died of SIGSEGV
    # first, the mismatched bytes having overrun a buffer). On NCCL (H200) the same case is an ERROR
    # on the short rank (its output is too small for the unsharded weight), or a HANG.
    report = _run(case_id)
    assert report.verdict is Verdict.CRASH, report.render()
    assert re.search(r"killed by SIG(ABRT|SEGV)", report.reason), report.render()


def test_uneven_shards_hang_with_a_scale_precomputed_before_the_first_unshard():
    # Two torchao behaviours meet. precompute_float8_dynamic_scale_for_fsdp stores the scale on the
    # DTensor's local WeightWithDynamicFloat8CastTensor (fsdp_utils.py:85). At the first unshard,
    # FSDP2's lazy init re-pads the local tensor of every rank whose shard is shorter than the
    # padded size (reset_sharded_param, _fsdp_param.py:1021-1055: subclasses never count as "the
    # same local tensor") and swaps in a new wrapper; torchao's __torch_dispatch__ rebuilds wrappers
    # without _precomputed_scale (fsdp_utils.py:204-208). So only the short rank falls back to the
    # dynamic cast and waits in its amax all-reduce (float8_utils.py:78-80) while the others are
    # already in the all-gather: a deadlock (also seen on NCCL, H200). Even shards keep the scale.
    spec = CaseSpec.parse("torchao:precompute:fp8_tensor:5x64:bf16:ws2:gather:s0")
    report = run_case(spec, RunOptions(backend="gloo", device="cpu", case_timeout=5.0))
    assert report.verdict is Verdict.HANG, report.render()
    # (FSDP2 calls all_gather_single on torch 2.13, all_gather_into_tensor on 2.11)
    assert "wait_tensor" in report.reason and "(all_gather_" in report.reason, report.render()


def test_pre_all_gather_hands_over_the_unpadded_float8_shard():
    # The root cause of the crashes above, without a collective (dist is not initialized here, so
    # reduce_amax is skipped): 5 rows at 2 ranks -> padded shard (3, 64); rank 1 holds 2 rows.
    impl = get_impl("torchao")
    weight = make_weight(CaseSpec.parse("torchao:fp8_tensor:5x64:bf16:ws2:gather:s0")).to(torch.bfloat16)
    param = impl.make_param("fp8_tensor", weight)
    padded = param.new_zeros((3, 64))
    padded.narrow(0, 0, 2).copy_(param[3:5])
    local = padded.narrow(0, 0, 2)  # what FSDP2 keeps as rank 1's shard
    assert len(inspect.signature(local.fsdp_pre_all_gather).parameters) == 1  # FSDP2's legacy signature
    (data,), _ = local.fsdp_pre_all_gather(None)
    assert data.dtype == torch.float8_e4m3fn  # why gloo needs the transport shim
    assert tuple(data.shape) == (2, 64)  # not the padded (3, 64) FSDP2 requires


# ------------------------------------------------------------------ ranks with zero rows
@pytest.mark.parametrize("case_id", [
    "torchao:fp8_tensor:5x64:bf16:ws4:gather:s0",     # shards of 2, 2, 1, 0 rows
    "torchao:fp8_tensor:4x64:fp32:ws3:steps:s0",      # 2, 2, 0
])
def test_a_rank_with_zero_rows_raises_alone(case_id):
    # The pre-hook's amax is torch.max(torch.abs(x)) (float8_utils.py:65), which raises on the empty
    # shard of the zero-row rank only; the others wait in the amax all-reduce.
    report = _run(case_id)
    assert report.verdict is Verdict.ERROR, report.render()
    assert "max(): Expected reduction dim to be specified for input.numel() == 0" in report.reason


def test_a_rank_with_zero_rows_cannot_precompute_the_scale():
    # precompute_float8_dynamic_scale_for_fsdp takes torch._foreach_norm(weights, ord=inf) of the
    # local shards (fsdp_utils.py:70), which raises on the zero-row rank's empty shard only.
    report = _run("torchao:precompute:fp8_tensor:5x64:bf16:ws4:gather:s0")
    assert report.verdict is Verdict.ERROR, report.render()
    assert "_foreach_norm cannot compute the infinity norm on an empty tensor" in report.reason


# ------------------------------------------------------------------ skipped, with the reason
@pytest.mark.parametrize("case_id, words", [
    ("torchao:nvfp4_2d:64x64:bf16:ws2:gather:s0", "implements only fp8_tensor"),
    ("torchao:fp8_tensor_e5m2:64x64:bf16:ws2:gather:s0", "implements only fp8_tensor"),
    ("torchao:fp8_tensor:4x32x64:bf16:ws2:gather:s0", "3-D expert weights"),
    ("torchao:fp8_tensor:64x64:bf16:ws2:hooks:s0", "one-argument signature"),
    ("torchao:precompute:fp8_tensor:64x64:bf16:ws8:virtual:s0", "collective over a real mesh"),
])
def test_cases_torchao_cannot_run_are_skipped_with_the_reason(case_id, words):
    report = _run(case_id)
    assert report.verdict is Verdict.SKIPPED and words in report.reason, report.render()


# ------------------------------------------------------------------ torchao's quantizer
@pytest.mark.parametrize("shape", [(64, 64), (7, 128), (5, 64)])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_torchaos_own_cast_matches_the_reference_quantizer(shape, dtype):
    # hp_tensor_to_float8_dynamic: scale = float32(448 / float64(amax)) (float8_utils.py:47), the
    # correctly rounded float32 quotient as TE computes it; then x.float() * scale, clamp, cast
    # (float8_training_tensor.py:153). Bit for bit the reference: no QUANTIZER_MISMATCH.
    spec = CaseSpec("torchao", "fp8_tensor", shape, dtype, 1, "gather")
    weight = make_weight(spec).to(spec.torch_dtype)
    own = get_impl("torchao").own_quantization("fp8_tensor", weight)
    golden = FORMATS["fp8_tensor"].quantize(weight)
    assert torch.equal(own["data"], golden.buffers["data"])
    assert torch.equal(own["scale_inv"].view(torch.int32), golden.buffers["scale_inv"].view(torch.int32))


def test_to_original_precision_divides_by_the_scale():
    # The root cause of the fp32 output mismatches: torchao's dequantization x / s is not TE's
    # x * fl(1/s) in float32 (for this weight: 136 of 512 elements), while both agree in bf16.
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    fmt = FORMATS["fp8_tensor"]
    for dtype, n_diff in (("fp32", 136), ("bf16", 0)):
        spec = CaseSpec("torchao", "fp8_tensor", (8, 64), dtype, 1, "gather")
        weight = make_weight(spec).to(spec.torch_dtype)
        ours = hp_tensor_to_float8_dynamic(weight, torch.float8_e4m3fn, LinearMMConfig()).to_original_precision()
        te = fmt.dequantize(fmt.quantize(weight)).to(spec.torch_dtype)
        assert int((ours != te).sum()) == n_diff, dtype


@pytest.mark.parametrize("case_id, skipped", [
    ("torchao:fp8_tensor:6x16:bf16:ws3:gather:s0:dcp-ws2-trained", True),  # seen as an ERROR on 1 x H200
    ("torchao:fp8_tensor:64x136:bf16:ws2:gather:s0:compile", True),
    ("torchao:fp8_tensor:64x64:bf16:ws3:gather:s0:dcp-ws2-trained", False),
    ("torchao:fp8_tensor:6x16:bf16:ws3:gather:s0:dcp-ws2", False),  # no forward before the save
])
def test_a_forward_the_gemm_refuses_on_cuda_skips_only_where_the_case_needs_it(case_id, skipped):
    """torch._scaled_mm on CUDA multiplies dims that are multiples of 16 only; a case that needs torchao's
    own forward of such a weight cannot run there (on the CPU it can: the GEMM is emulated)."""
    spec = CaseSpec.parse(case_id)
    impl = get_impl("torchao")
    reason = impl._forward_refusal(spec, torch.device("cuda", 0))
    assert (reason is not None) == skipped, reason
    assert reason is None or "multiples of 16" in reason
    assert impl._forward_refusal(spec, torch.device("cpu")) is None
