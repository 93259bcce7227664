"""The format, written as a spec: FP8 E4M3 data with one float32 scale per row of the weight.

qgather builds every golden with it (the full weight quantized on one device), derives the shapes
it tests from its layout rules, and judges the library's own quantizer against it.
"""

import torch

from qgather.formats.base import Format, flat_dims, full

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


class Fp8RowwiseFormat(Format):
    name = "fp8_rowwise"                     # the name case ids carry
    row_block = 1                            # a row is a scale block: every shard starts on one
    rows_per_entry = {"data": 1, "scale_inv": 1}   # each buffer's rows, in the row layout FSDP2 shards
    rowwise_rows = {"data": (0, 1), "scale_inv": (0, 1)}   # (axis, rows per entry) dequantize reads
    has_columnwise = False                   # no transposed copy

    def buffer_specs(self, shape):           # (shape, dtype) of each buffer for a weight of `shape`
        m, k = flat_dims(tuple(shape))
        return {"data": ((m, k), torch.uint8), "scale_inv": ((m,), torch.float32)}

    def valid_regions(self, shape):          # what is compared: here every element (no padding)
        return {name: full(s) for name, (s, _) in self.buffer_specs(shape).items()}

    def row_specs(self, shape):              # the buffers in row layout (dim 0: rows of the weight)
        return self.buffer_specs(shape)

    def _quantize(self, x2, amax, shape):    # x2: the weight as (M, K); amax: per-tensor, unused here
        row_amax = x2.float().abs().amax(dim=1) if x2.shape[1] else x2.new_zeros(x2.shape[0], dtype=torch.float32)
        scale = FP8_MAX / row_amax
        scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
        scale = torch.where(row_amax == 0, 1.0, scale)
        data = (x2.float() * scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        return self._make(shape, {"data": data, "scale_inv": 1.0 / scale})

    def _dequantize(self, q):
        return q.buffers["data"].view(FP8).float() * q.buffers["scale_inv"][:, None]

    def _to_rows(self, q):                   # (row buffers, per-tensor buffers)
        return {"data": q.buffers["data"], "scale_inv": q.buffers["scale_inv"]}, {}

    def _from_rows(self, rows, glob, shape):
        return self._make(shape, {"data": rows["data"].contiguous(), "scale_inv": rows["scale_inv"].contiguous()})
