"""TransformerEngine's quantized tensors under test: Float8Tensor, Float8BlockwiseQTensor,
MXFP8Tensor and NVFP4Tensor, with TE's own FSDP2 hooks.

Parameters are built the way a TE model holds them: TE's quantizer applied to the full weight on
the GPU. NVFP4's quantization kernels need sm_100, so on older GPUs the NVFP4Tensor is built
from the harness's reference bits (bit-exact with TE's reference quantizer, see the golden
corpus) and the steps/reshard scenarios, which re-quantize shards, are skipped there.
TE's pre-hook reads FSDP state from the module, so the hooks/virtual scenarios (module=None) do
not apply.

Limit (seen on 2 x H200, TE 2.20.2): only Float8Tensor handles the ops FSDP2 shards with (split,
new_zeros, copy_). Float8BlockwiseQTensor and NVFP4Tensor fall back to QuantizedTensor's default
dispatch, which dequantizes, so sharding an already-quantized weight gathers bf16 (DEGRADED). TE's
supported route for them is deferred init: the module is built under quantized_model_init,
fully_shard shards the high-precision parameter, and reset_parameters quantizes each local shard.
That route (where shard alignment to the 128-row / 16-row blocks matters) is not modelled here yet.
"""

from __future__ import annotations

import math

import torch

from harness.cases import CaseSpec
from harness.formats import FORMATS
from harness.impls.base import Implementation

NVFP4 = ("nvfp4_1d", "nvfp4_2d")


def _te_import_error() -> str | None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        return f"transformer_engine unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return None


def _compute_capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


class TransformerEngineImplementation(Implementation):
    name = "te"
    formats = tuple(FORMATS)
    scenarios = ("gather", "steps", "reshard")
    devices = ("cuda",)

    def skip_reason(self, spec: CaseSpec, device: torch.device) -> str | None:
        reason = super().skip_reason(spec, device) or _te_import_error()
        if reason:
            return reason
        if len(spec.shape) != 2:
            return "te: TE's linear weights are 2-D; 3-D expert weights are not built here"
        sm = _compute_capability()
        if spec.fmt == "mxfp8" and sm < (10, 0):
            return f"te: TE's MXFP8 kernels need sm_100 (this GPU is sm_{sm[0]}{sm[1]})"
        if spec.fmt in NVFP4 and spec.scenario != "gather" and sm < (10, 0):
            return f"te: re-quantizing NVFP4 shards needs TE's sm_100 kernels (this GPU is sm_{sm[0]}{sm[1]})"
        return None

    def make_param(self, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        if fmt in NVFP4 and _compute_capability() < (10, 0):
            return _nvfp4_from_reference_bits(fmt, weight)
        from harness.te_quantizers import make_quantizer

        return make_quantizer(fmt)(weight.cuda())

    def own_quantization(self, fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
        from harness.te_quantizers import te_quantize

        return te_quantize(fmt, weight.cuda())

    def read_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        if hasattr(param, "_data") and not hasattr(param, "_rowwise_data"):
            m, k = math.prod(param.shape[:-1]), param.shape[-1]
            return {"data": param._data.view(torch.uint8).reshape(m, k),
                    "scale_inv": param._scale_inv.reshape(1).float()}
        if getattr(param, "_columnwise_data", None) is None and hasattr(param, "_create_columnwise"):
            # TE derives columnwise only when the backward asks; ask for it as the backward would.
            param._create_columnwise()
        names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
                 "amax_rowwise", "amax_columnwise")
        out = {}
        for name in names:
            value = getattr(param, "_" + name, None)
            if value is not None:
                out[name] = value if value.dtype in (torch.uint8, torch.float32) else value.view(torch.uint8)
        return out

    def requantize_shard(self, local: torch.Tensor, master_rows: torch.Tensor, group) -> None:
        # TE's pre-hook set local.amax_reduction_group, so current scaling all-reduces the amax.
        local.quantize_(master_rows.to(local.device))

    def is_quantized(self, param: torch.Tensor) -> bool:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

        return isinstance(param, QuantizedTensor)

    def forward(self, param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, param.dequantize(dtype=x.dtype).transpose(-1, -2))


def _nvfp4_from_reference_bits(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor import NVFP4Quantizer
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Tensor

    q = FORMATS[fmt].quantize(weight.cuda())
    b = q.buffers
    quantizer = NVFP4Quantizer(rowwise=True, columnwise=True, with_2d_quantization=fmt == "nvfp4_2d")
    return NVFP4Tensor(
        shape=tuple(weight.shape), dtype=weight.dtype, fp4_dtype=tex.DType.kFloat4E2M1,
        rowwise_data=b["rowwise_data"], rowwise_scale_inv=b["rowwise_scale_inv"],
        columnwise_data=b["columnwise_data"], columnwise_scale_inv=b["columnwise_scale_inv"],
        amax_rowwise=b["amax_rowwise"], amax_columnwise=b["amax_columnwise"],
        quantizer=quantizer, requires_grad=False, with_gemm_swizzled_scales=False,
        device=b["rowwise_data"].device)


FACTORIES = {"te": TransformerEngineImplementation}
