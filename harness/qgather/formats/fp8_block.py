"""FP8 block scaling (TE Float8BlockwiseQTensor, Float8BlockQuantizer, power-of-two scales, E4M3).

fp8_block (block_scaling_dim=2, weights): one scale per 128x128 tile; edge tiles are partial.
  rowwise_data uint8 (M, K); rowwise_scale_inv f32 (ceil(M/128), round_up(ceil(K/128), 4));
  columnwise_data uint8 (K, M) = rowwise_data^T; columnwise_scale_inv f32
  (ceil(K/128), round_up(ceil(M/128), 4)) = tile scales^T.
  Row layout: {rowwise_data (M, K) r=1, rowwise_scale_inv valid (ceil(M/128), ceil(K/128)) r=128};
  from_rows derives the columnwise buffers by transposing (2-D tiles transpose exactly).

fp8_block_1x128 (block_scaling_dim=1): rowwise 1x128 blocks along K; columnwise data (K, M) with
  1x128 blocks along M (i.e. 128x1 blocks of x).
  rowwise_scale_inv f32 (ceil(K/128), round_up(M, 4)) (M in dim 1);
  columnwise_scale_inv f32 (ceil(M/128), round_up(K, 4)).
  Row layout: {rowwise_data (M, K) r=1, rowwise_scale_inv valid^T (M, ceil(K/128)) r=1,
  columnwise_data^T (M, K) r=1, columnwise_scale_inv valid (ceil(M/128), K) r=128}.
"""

from __future__ import annotations

import torch

from . import numerics as nx
from .base import Format, QuantizedTensor, flat_dims, full

BLOCK = 128


def _block_counts(shape) -> tuple[int, int, int, int]:
    """M, K and the number of 128-blocks along each (2D tiles and 1D blocks share the grid)."""
    m, k = flat_dims(tuple(shape))
    return m, k, nx.ceil_div(m, BLOCK), nx.ceil_div(k, BLOCK)
FP8 = torch.float8_e4m3fn


def _tiles_dequantized(data: torch.Tensor, tile_scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 (rows, cols) of fp8 codes `data` times their 128x128 tile's scale_inv (valid tiles)."""
    rows, cols = data.shape
    rt, ct = tile_scale_inv.shape
    vals = nx.pad2d(nx.fp8_values(data, FP8), rt * BLOCK, ct * BLOCK)  # a new tensor: scaled in place
    vals.view(rt, BLOCK, ct, BLOCK).mul_(tile_scale_inv.reshape(rt, 1, ct, 1))
    return vals.view(rt * BLOCK, ct * BLOCK)[:rows, :cols]


def _rows_dequantized(data: torch.Tensor, sinv: torch.Tensor) -> torch.Tensor:
    """float32 (M, K) of fp8 codes `data` (M, K) times their 1x128 block's scale_inv, `sinv` (M, Kb)."""
    m, k = data.shape
    kb = sinv.shape[1]
    vals = nx.pad2d(nx.fp8_values(data, FP8), m, kb * BLOCK)
    return (vals.reshape(m, kb, BLOCK) * sinv.reshape(m, kb, 1)).view(m, kb * BLOCK)[:, :k]


class Fp8Block2DFormat(Format):
    name = "fp8_block"
    row_block = BLOCK
    rows_per_entry = {"rowwise_data": 1, "rowwise_scale_inv": BLOCK}
    rowwise_rows = {"rowwise_data": (0, 1), "rowwise_scale_inv": (0, BLOCK)}


    def buffer_specs(self, shape):
        m, k, mt, kt = _block_counts(shape)
        return {
            "rowwise_data": ((m, k), torch.uint8),
            "rowwise_scale_inv": ((mt, nx.round_up(kt, 4)), torch.float32),
            "columnwise_data": ((k, m), torch.uint8),
            "columnwise_scale_inv": ((kt, nx.round_up(mt, 4)), torch.float32),
        }

    def valid_regions(self, shape):
        m, k, mt, kt = _block_counts(shape)
        return {"rowwise_data": full((m, k)), "rowwise_scale_inv": full((mt, kt)),
                "columnwise_data": full((k, m)), "columnwise_scale_inv": full((kt, mt))}

    def row_specs(self, shape):
        m, k, mt, kt = _block_counts(shape)
        return {"rowwise_data": ((m, k), torch.uint8), "rowwise_scale_inv": ((mt, kt), torch.float32)}

    def _assemble(self, shape, data, tile_scale_inv) -> QuantizedTensor:
        m, k, mt, kt = _block_counts(shape)
        return self._make(shape, {
            "rowwise_data": data,
            "rowwise_scale_inv": nx.padded_zeros(tile_scale_inv, (mt, nx.round_up(kt, 4))),
            "columnwise_data": data.t().contiguous(),
            "columnwise_scale_inv": nx.padded_zeros(tile_scale_inv.t(), (kt, nx.round_up(mt, 4))),
        })

    def _quantize(self, x2, amax, shape):
        m, k, mt, kt = _block_counts(shape)
        xp = nx.pad2d(x2, mt * BLOCK, kt * BLOCK)
        tile_amax = nx.abs_amax(xp.view(mt, BLOCK, kt, BLOCK), dim=(1, 3))
        scale, scale_inv = nx.pow2_block_scale(tile_amax, nx.FP8_E4M3_MAX)
        v = nx.as_float32(xp)
        v.view(mt, BLOCK, kt, BLOCK).mul_(scale.view(mt, 1, kt, 1))
        data = nx.fp8_bits(v, FP8)  # |v| <= 448 by construction of the power-of-two scale
        if data.shape != (m, k):
            data = data[:m, :k].contiguous()
        return self._assemble(shape, data, scale_inv)

    def derived_views(self, q):
        return {"columnwise_data": q.buffers["rowwise_data"].t()}

    def _dequantize(self, q):
        return _tiles_dequantized(*self._dequantize_parts(q)[1])

    def _dequantize_parts(self, q):
        scale_inv = q.buffers["rowwise_scale_inv"][q.valid["rowwise_scale_inv"]]
        return _tiles_dequantized, (q.buffers["rowwise_data"], scale_inv)

    def _dequantize_row_layout(self, rows, glob, shape):
        return _tiles_dequantized(rows["rowwise_data"], rows["rowwise_scale_inv"])

    def _dequantize_columnwise(self, q):
        v = q.valid
        out_t = _tiles_dequantized(q.buffers["columnwise_data"],
                              q.buffers["columnwise_scale_inv"][v["columnwise_scale_inv"]])
        return out_t.t()

    def _to_rows(self, q):
        v = q.valid
        return ({"rowwise_data": q.buffers["rowwise_data"],
                 "rowwise_scale_inv": q.buffers["rowwise_scale_inv"][v["rowwise_scale_inv"]]}, {})

    def _from_rows(self, rows, glob, shape):
        return self._assemble(shape, rows["rowwise_data"].contiguous(), rows["rowwise_scale_inv"])


class Fp8Block1DFormat(Format):
    name = "fp8_block_1x128"
    row_block = BLOCK  # the columnwise 128x1 blocks run along M
    rows_per_entry = {"rowwise_data": 1, "rowwise_scale_inv": 1, "columnwise_data": 1,
                      "columnwise_scale_inv": BLOCK}
    rowwise_rows = {"rowwise_data": (0, 1), "rowwise_scale_inv": (1, 1)}  # the scales hold M in dim 1


    def buffer_specs(self, shape):
        m, k, mb, kb = _block_counts(shape)
        return {
            "rowwise_data": ((m, k), torch.uint8),
            "rowwise_scale_inv": ((kb, nx.round_up(m, 4)), torch.float32),
            "columnwise_data": ((k, m), torch.uint8),
            "columnwise_scale_inv": ((mb, nx.round_up(k, 4)), torch.float32),
        }

    def valid_regions(self, shape):
        m, k, mb, kb = _block_counts(shape)
        return {"rowwise_data": full((m, k)), "rowwise_scale_inv": full((kb, m)),
                "columnwise_data": full((k, m)), "columnwise_scale_inv": full((mb, k))}

    def row_specs(self, shape):
        m, k, mb, kb = _block_counts(shape)
        return {"rowwise_data": ((m, k), torch.uint8), "rowwise_scale_inv": ((m, kb), torch.float32),
                "columnwise_data": ((m, k), torch.uint8),
                "columnwise_scale_inv": ((mb, k), torch.float32)}

    def _assemble(self, shape, row_data, row_sinv, col_data_mk, col_sinv) -> QuantizedTensor:
        """row_sinv: (M, Kb); col_data_mk: (M, K) (not yet transposed); col_sinv: (Mb, K)."""
        m, k, mb, kb = _block_counts(shape)
        return self._make(shape, {
            "rowwise_data": row_data,
            "rowwise_scale_inv": nx.padded_zeros(row_sinv.t(), (kb, nx.round_up(m, 4))),
            "columnwise_data": col_data_mk.t().contiguous(),
            "columnwise_scale_inv": nx.padded_zeros(col_sinv, (mb, nx.round_up(k, 4))),
        })

    def _quantize(self, x2, amax, shape):
        m, k, mb, kb = _block_counts(shape)
        # rowwise: 1x128 blocks along K
        xr = nx.pad2d(x2, m, kb * BLOCK)
        r_scale, r_sinv = nx.pow2_block_scale(nx.abs_amax(xr.view(m, kb, BLOCK), dim=2), nx.FP8_E4M3_MAX)
        v = nx.as_float32(xr)
        v.view(m, kb, BLOCK).mul_(r_scale.view(m, kb, 1))
        row_data = nx.fp8_bits(v, FP8)
        del v
        if kb * BLOCK != k:
            row_data = row_data[:, :k].contiguous()
        # columnwise: 128x1 blocks along M
        xc = nx.pad2d(x2, mb * BLOCK, k)
        c_scale, c_sinv = nx.pow2_block_scale(nx.abs_amax(xc.view(mb, BLOCK, k), dim=1), nx.FP8_E4M3_MAX)
        v = nx.as_float32(xc)
        v.view(mb, BLOCK, k).mul_(c_scale.view(mb, 1, k))
        col_data = nx.fp8_bits(v, FP8)[:m]
        return self._assemble(shape, row_data, r_sinv, col_data, c_sinv)

    def _dequantize(self, q):
        sinv = q.buffers["rowwise_scale_inv"][q.valid["rowwise_scale_inv"]].t()  # (M, Kb)
        return _rows_dequantized(q.buffers["rowwise_data"], sinv)

    def _dequantize_row_layout(self, rows, glob, shape):
        return _rows_dequantized(rows["rowwise_data"], rows["rowwise_scale_inv"])

    def _dequantize_columnwise(self, q):
        m, k, mb, kb = _block_counts(q.shape)
        sinv = q.buffers["columnwise_scale_inv"][q.valid["columnwise_scale_inv"]]  # (Mb, K)
        vals = nx.pad2d(nx.fp8_values(q.buffers["columnwise_data"], FP8).t(), mb * BLOCK, k)
        return (vals.reshape(mb, BLOCK, k) * sinv.reshape(mb, 1, k)).view(mb * BLOCK, k)[:m]

    def _to_rows(self, q):
        b, v = q.buffers, q.valid
        return ({"rowwise_data": b["rowwise_data"],
                 "rowwise_scale_inv": b["rowwise_scale_inv"][v["rowwise_scale_inv"]].t(),
                 "columnwise_data": b["columnwise_data"].t(),
                 "columnwise_scale_inv": b["columnwise_scale_inv"][v["columnwise_scale_inv"]]}, {})

    def _from_rows(self, rows, glob, shape):
        return self._assemble(shape, rows["rowwise_data"].contiguous(), rows["rowwise_scale_inv"],
                              rows["columnwise_data"], rows["columnwise_scale_inv"])
