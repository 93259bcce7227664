"""TE's NVFP4 weight quantizer on GPUs without TE's NVFP4 kernels (below sm_100).

A subclass of TE's own NVFP4Quantizer, so that TE's reset_parameters treats it as one: it hands
it the shard group's amax reduction (TE does that only for instances of its quantizer classes).
Its quantization builds the NVFP4Tensor from the harness's reference bits of the shard, scaled
with the all-reduced (global) amax, exactly what TE's kernel computes on sm_100 (the reference
formats are bit-exact with TE's reference NVFP4 quantizer, tests/gpu/test_te_crosscheck.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# A subclass of TE's class: this module imports TE at its top, so only route.py's function that
# installs the quantizer imports it, on a GPU where TE imported (TE is optional).
from transformer_engine.pytorch.tensor import NVFP4Quantizer

from qgather.errors import HarnessFault
from qgather.formats import FormatError
from qgather.impls.te.tensors import nvfp4_tensor_from_bits

#: quantizer settings the reference bits do not model
UNMODELLED = ("with_rht", "stochastic_rounding", "row_scaled_nvfp4", "nvfp4_use_4over6")


class ReferenceBitsNVFP4Quantizer(NVFP4Quantizer):
    """TE's NVFP4Quantizer whose quantization is the harness's reference bits (see the module docstring)."""

    fmt: str = "nvfp4_2d"

    @classmethod
    def replacing(cls, original: NVFP4Quantizer, fmt: str) -> ReferenceBitsNVFP4Quantizer:
        unmodelled = [name for name in UNMODELLED if getattr(original, name, False)]
        if unmodelled:
            raise HarnessFault(f"the reference NVFP4 bits do not model the recipe's {', '.join(unmodelled)}")
        quantizer = cls(rowwise=original.rowwise_usage, columnwise=original.columnwise_usage,
                        with_2d_quantization=original.with_2d_quantization)
        quantizer.fmt = fmt
        return quantizer

    def quantize_impl(self, tensor: torch.Tensor):
        amax = tensor.detach().abs().amax().float() if tensor.numel() else tensor.new_zeros((), dtype=torch.float32)
        if self.with_amax_reduction and self.amax_reduction_group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_reduction_group)
        try:
            return nvfp4_tensor_from_bits(self.fmt, tensor.detach(), self, amax=amax)
        except FormatError as exc:
            raise HarnessFault(f"the reference-bits stand-in for TE's NVFP4 kernel cannot quantize this "
                               f"{tuple(tensor.shape)} shard ({exc}); only TE's sm_100 kernel can say "
                               "what it does") from None
