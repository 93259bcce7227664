"""FP8 with one per-tensor scale and current scaling (TE Float8Tensor + Float8CurrentScalingQuantizer).

Buffers: data uint8 (M, K) (E4M3 or E5M2 bits), scale_inv float32 (1,). The transpose that TE
keeps on some GPUs is not a buffer here (it is data.t(), exact, and never gathered).
Row layout: {data (M, K), r=1}; glob {scale_inv}.
"""

from __future__ import annotations

import torch

from . import numerics as nx
from .base import Format, QuantizedTensor, flat_dims, full


class Fp8TensorFormat(Format):
    row_block = 1
    per_tensor = True
    has_columnwise = False
    allow_empty_k = True
    rows_per_entry = {"data": 1}
    rowwise_rows = {"data": (0, 1)}
    glob_keys = ("scale_inv",)

    def __init__(self, name: str, fp8_dtype: torch.dtype, fp8_max: float):
        self.name = name
        self.fp8_dtype = fp8_dtype
        self.fp8_max = fp8_max

    def buffer_specs(self, shape):
        m, k = flat_dims(tuple(shape))
        return {"data": ((m, k), torch.uint8), "scale_inv": ((1,), torch.float32)}

    def valid_regions(self, shape):
        return {name: full(s) for name, (s, _) in self.buffer_specs(shape).items()}

    def row_specs(self, shape):
        m, k = flat_dims(tuple(shape))
        return {"data": ((m, k), torch.uint8)}

    def _quantize(self, x2, amax, shape) -> QuantizedTensor:
        scale, scale_inv = nx.current_scale(amax, self.fp8_max)
        v = nx.as_float32(x2).mul_(scale)
        data = nx.fp8_bits(v, self.fp8_dtype, self.fp8_max)
        return self._make(shape, {"data": data, "scale_inv": scale_inv})

    def _dequantize(self, q):
        return nx.fp8_values(q.buffers["data"], self.fp8_dtype) * q.buffers["scale_inv"]

    def _dequantize_row_layout(self, rows, glob, shape):
        return nx.fp8_values(rows["data"], self.fp8_dtype) * glob["scale_inv"]

    def _to_rows(self, q):
        return {"data": q.buffers["data"]}, {"scale_inv": q.buffers["scale_inv"]}

    def _from_rows(self, rows, glob, shape):
        return self._make(shape, {"data": rows["data"].contiguous(),
                                  "scale_inv": glob["scale_inv"].contiguous()})
