"""`te:prequantized`: what happens to a user who quantizes the FULL weight with TE and then
shards the quantized tensor with `fully_shard` (not TE's supported route; see `te`, route.py).

Parameters are TE's quantizer applied to the full weight on the GPU. NVFP4's quantization kernels
need sm_100, so on older GPUs the NVFP4Tensor is built from the harness's reference bits
(bit-exact with TE's reference quantizer, see the golden corpus) and the steps/reshard
scenarios, which re-quantize shards, are skipped there. TE's pre-hook reads FSDP state from the
module, so the hooks/virtual scenarios (module=None) do not apply.

Limit (seen on 2 x H200, TE 2.20.2): only Float8Tensor handles the ops FSDP2 shards with (split,
new_zeros, copy_). Float8BlockwiseQTensor and NVFP4Tensor fall back to QuantizedTensor's default
dispatch, which dequantizes, so sharding an already-quantized weight gathers bf16 (DEGRADED). TE's
supported route for them is deferred init: the module is built under quantized_model_init,
fully_shard shards the high-precision parameter, and reset_parameters quantizes each local shard.
That route is the `te` implementation (harness.impls.te.route).
"""

from __future__ import annotations

import torch

from harness.cases import CaseSpec
from harness.formats import FORMATS
from harness.impls.base import Implementation
from harness.impls.te.environment import compute_capability, te_import_error
from harness.impls.te.tensors import nvfp4_tensor_from_bits, read_te_buffers

NVFP4 = ("nvfp4_1d", "nvfp4_2d")


class PrequantizedImplementation(Implementation):
    name = "te:prequantized"
    formats = tuple(FORMATS)
    scenarios = ("gather", "steps", "reshard")
    devices = ("cuda",)
    # TE refuses in its FSDP2 hooks with an assertion that names the constraint (NVFP4's shard_M % 16;
    # FSDP2's own AssertionErrors are not TE refusing) and NotImplementedError (1-D block scaling).
    rejection_types = ("AssertionError: FSDP2 requires", "NotImplementedError")

    def skip_reason(self, spec: CaseSpec, device: torch.device) -> str | None:
        reason = super().skip_reason(spec, device) or te_import_error()
        if reason:
            return reason
        if len(spec.shape) != 2:
            return "te: TE's linear weights are 2-D; 3-D expert weights are not built here"
        sm = compute_capability()
        if spec.fmt == "mxfp8" and sm < (10, 0):
            return f"te: TE's MXFP8 kernels need sm_100 (this GPU is sm_{sm[0]}{sm[1]})"
        if spec.fmt in NVFP4 and spec.scenario != "gather" and sm < (10, 0):
            return f"te: re-quantizing NVFP4 shards needs TE's sm_100 kernels (this GPU is sm_{sm[0]}{sm[1]})"
        return None

    def make_param(self, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        if fmt in NVFP4 and compute_capability() < (10, 0):
            return _nvfp4_from_reference_bits(fmt, weight)
        from harness.impls.te.quantizers import make_quantizer

        return make_quantizer(fmt)(weight.cuda())

    def own_quantization(self, fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
        from harness.impls.te.quantizers import te_quantize

        return te_quantize(fmt, weight.cuda())

    def read_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return read_te_buffers(param)

    def requantize_shard(self, local: torch.Tensor, master_rows: torch.Tensor, group) -> None:
        # TE's pre-hook set local.amax_reduction_group, so current scaling all-reduces the amax.
        local.quantize_(master_rows.to(local.device))

    def is_quantized(self, param: torch.Tensor) -> bool:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

        return isinstance(param, QuantizedTensor)

    def own_dequantize(self, param: torch.Tensor) -> torch.Tensor:
        return param.dequantize(dtype=torch.float32)

    def forward(self, param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, param.dequantize(dtype=x.dtype).transpose(-1, -2))


def _nvfp4_from_reference_bits(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    from transformer_engine.pytorch.tensor import NVFP4Quantizer

    quantizer = NVFP4Quantizer(rowwise=True, columnwise=True, with_2d_quantization=fmt == "nvfp4_2d")
    return nvfp4_tensor_from_bits(fmt, weight.cuda(), quantizer)
