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
That route is the `te` implementation (qgather.impls.te.route).
"""

from __future__ import annotations

import torch

from qgather.formats import FORMATS
from qgather.impls.te.adapter import NVFP4, TEAdapter
from qgather.impls.te.environment import has_nvfp4_kernels
from qgather.impls.te.quantizers import make_quantizer
from qgather.impls.te.tensors import nvfp4_tensor_from_bits


class PrequantizedImplementation(TEAdapter):
    name = "te:prequantized"
    formats = tuple(FORMATS)

    def make_param(self, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        if fmt in NVFP4 and not has_nvfp4_kernels():
            return _nvfp4_from_reference_bits(fmt, weight)
        return make_quantizer(fmt)(weight.cuda())


def _nvfp4_from_reference_bits(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    from transformer_engine.pytorch.tensor import NVFP4Quantizer  # TE is optional: imported on use

    quantizer = NVFP4Quantizer(rowwise=True, columnwise=True, with_2d_quantization=fmt == "nvfp4_2d")
    return nvfp4_tensor_from_bits(fmt, weight.cuda(), quantizer)
