"""MXFP8 (TE MXFP8Tensor / MXFP8Quantizer, E4M3 data, E8M0 scales, blocks of 32).

Requires M % 32 == 0 and K % 32 == 0.
  rowwise_data uint8 (M, K), 1x32 blocks along K; rowwise_scale_inv uint8 E8M0
  (round_up(M, 128), round_up(K/32, 4)), valid [:M, :K/32].
  columnwise_data uint8 (M, K) (NOT transposed), 32x1 blocks along M; columnwise_scale_inv uint8
  (round_up(M/32, 4), round_up(K, 128)), valid [:M/32, :K].
Row layout: {rowwise_data r=1, rowwise_scale_inv valid (M, K/32) r=1, columnwise_data (M, K) r=1,
columnwise_scale_inv valid (M/32, K) r=32}.

Numerics follow TE's kernels (utils.cuh / ptx.cuh): code = float_to_e8m0(amax * fl32(1/448))
(round up to a power of two), data = satfinite_cast(x * exp2f_rcp(code)) with exp2f_rcp(0) == 1.
"""

from __future__ import annotations

import torch

from . import numerics as nx
from .base import Format, flat_dims, full

BLOCK = 32
FP8 = torch.float8_e4m3fn


def _blocks_dequantized(data: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float32 (M, K) of E4M3 `data` (M, K) times the value of each 1x32 block's E8M0 code (M, K/32)."""
    m, k = data.shape
    vals = nx.fp8_values(data, FP8).view(m, k // BLOCK, BLOCK)
    return (vals * nx.e8m0_value(codes).reshape(m, k // BLOCK, 1)).view(m, k)


class Mxfp8Format(Format):
    name = "mxfp8"
    row_block = BLOCK
    k_multiple = BLOCK
    m_multiple = BLOCK
    rows_per_entry = {"rowwise_data": 1, "rowwise_scale_inv": 1, "columnwise_data": 1,
                      "columnwise_scale_inv": BLOCK}
    rowwise_rows = {"rowwise_data": (0, 1), "rowwise_scale_inv": (0, 1)}

    def buffer_specs(self, shape):
        m, k = flat_dims(tuple(shape))
        return {
            "rowwise_data": ((m, k), torch.uint8),
            "rowwise_scale_inv": ((nx.round_up(m, 128), nx.round_up(k // BLOCK, 4)), torch.uint8),
            "columnwise_data": ((m, k), torch.uint8),
            "columnwise_scale_inv": ((nx.round_up(m // BLOCK, 4), nx.round_up(k, 128)), torch.uint8),
        }

    def valid_regions(self, shape):
        m, k = flat_dims(tuple(shape))
        return {"rowwise_data": full((m, k)), "rowwise_scale_inv": full((m, k // BLOCK)),
                "columnwise_data": full((m, k)), "columnwise_scale_inv": full((m // BLOCK, k))}

    def row_specs(self, shape):
        m, k = flat_dims(tuple(shape))
        return {"rowwise_data": ((m, k), torch.uint8), "rowwise_scale_inv": ((m, k // BLOCK), torch.uint8),
                "columnwise_data": ((m, k), torch.uint8),
                "columnwise_scale_inv": ((m // BLOCK, k), torch.uint8)}

    def _assemble(self, shape, row_data, row_codes, col_data, col_codes):
        specs = self.buffer_specs(shape)
        return self._make(shape, {
            "rowwise_data": row_data,
            "rowwise_scale_inv": nx.padded_zeros(row_codes, specs["rowwise_scale_inv"][0]),
            "columnwise_data": col_data,
            "columnwise_scale_inv": nx.padded_zeros(col_codes, specs["columnwise_scale_inv"][0]),
        })

    def _quantize(self, x2, amax, shape):
        m, k = x2.shape
        # rowwise: 1x32 blocks along K
        r_codes = nx.e8m0_from_amax(nx.abs_amax(x2.view(m, k // BLOCK, BLOCK), dim=2), nx.FP8_E4M3_MAX)
        v = nx.as_float32(x2)
        v.view(m, k // BLOCK, BLOCK).mul_(nx.e8m0_quant_scale(r_codes).view(m, k // BLOCK, 1))
        row_data = nx.fp8_bits(v, FP8)  # |v| <= 448 since 2^(code-127) >= amax/448
        del v
        # columnwise: 32x1 blocks along M
        c_codes = nx.e8m0_from_amax(nx.abs_amax(x2.view(m // BLOCK, BLOCK, k), dim=1), nx.FP8_E4M3_MAX)
        v = nx.as_float32(x2)
        v.view(m // BLOCK, BLOCK, k).mul_(nx.e8m0_quant_scale(c_codes).view(m // BLOCK, 1, k))
        col_data = nx.fp8_bits(v, FP8)
        return self._assemble(shape, row_data, r_codes, col_data, c_codes)

    def _dequantize(self, q):
        codes = q.buffers["rowwise_scale_inv"][q.valid["rowwise_scale_inv"]]
        return _blocks_dequantized(q.buffers["rowwise_data"], codes)

    def _dequantize_row_layout(self, rows, glob, shape):
        return _blocks_dequantized(rows["rowwise_data"], rows["rowwise_scale_inv"])

    def _dequantize_columnwise(self, q):
        m, k = flat_dims(q.shape)
        codes = q.buffers["columnwise_scale_inv"][q.valid["columnwise_scale_inv"]]
        vals = nx.fp8_values(q.buffers["columnwise_data"], FP8).view(m // BLOCK, BLOCK, k)
        return (vals * nx.e8m0_value(codes).reshape(m // BLOCK, 1, k)).view(m, k)

    def _to_rows(self, q):
        b, v = q.buffers, q.valid
        return ({"rowwise_data": b["rowwise_data"],
                 "rowwise_scale_inv": b["rowwise_scale_inv"][v["rowwise_scale_inv"]],
                 "columnwise_data": b["columnwise_data"],
                 "columnwise_scale_inv": b["columnwise_scale_inv"][v["columnwise_scale_inv"]]}, {})

    def _from_rows(self, rows, glob, shape):
        return self._assemble(shape, rows["rowwise_data"].contiguous(), rows["rowwise_scale_inv"],
                              rows["columnwise_data"].contiguous(), rows["columnwise_scale_inv"])
