"""NVFP4 (TE NVFP4Tensor, NVFP4BlockScaling; numerics of TE's reference NVFP4QuantizerRef).

Requires K % 16 == 0 and M even (columnwise data packs two rows of x per byte). M need not be a
multiple of 16: the last block along M is partial (zero padding, as TE's reference pads).
  rowwise_data uint8 (M, K/2): E2M1 codes of x, element 2c in the low nibble.
  rowwise_scale_inv uint8 E4M3 (round_up(M, 128), round_up(K/16, 4)), valid [:M, :K/16].
  columnwise_data uint8 (K, M/2): codes of x^T packed along M.
  columnwise_scale_inv uint8 (round_up(K, 128), round_up(ceil(M/16), 4)), valid [:K, :ceil(M/16)].
  amax_rowwise, amax_columnwise float32 (1,): the global amax the scales were computed from.

nvfp4_1d: 1x16 blocks for rowwise; columnwise is the 1x16 quantization of x^T (16x1 blocks of x)
  with the same global amax.
  Row layout: {rowwise_data (M, K/2) r=1, rowwise_scale_inv valid (M, K/16) r=1,
  columnwise_data^T (M/2, K) r=2, columnwise_scale_inv valid^T (ceil(M/16), K) r=16}.
nvfp4_2d: one scale per 16x16 tile (written on each of the tile's 16 rows); columnwise data and
  scales are the exact transposes of the tile results.
  Row layout: {rowwise_data r=1, rowwise_scale_inv valid r=1}; from_rows derives columnwise.
Both: glob {amax_rowwise, amax_columnwise}.
"""

from __future__ import annotations

import torch

from . import numerics as nx
from .base import Format, flat_dims, full

BLOCK = 16
E4M3 = torch.float8_e4m3fn


def _blocks_dequantized(packed: torch.Tensor, scale_bits: torch.Tensor, amax: torch.Tensor,
                        pair_table: torch.Tensor) -> torch.Tensor:
    """float32 (R, C) of packed (R, C/2) E2M1 codes times their 1x16 block's factor from its scale
    bits (R, C/16) and the per-tensor amax (numerics.nvfp4_dequant_factor), the codes' values looked
    up in `pair_table` (numerics.e2m1_pair_table)."""
    factor = nx.nvfp4_dequant_factor(scale_bits, amax)
    r, c = packed.shape[0], packed.shape[1] * 2
    vals = nx.e2m1_pairs_looked_up(packed, pair_table).view(r, c // BLOCK, BLOCK)  # new: scaled in place
    vals.mul_(factor.reshape(r, c // BLOCK, 1))
    return vals.view(r, c)


class _Nvfp4Base(Format):
    row_block = BLOCK
    per_tensor = True
    k_multiple = BLOCK
    m_multiple = 2
    glob_keys = ("amax_rowwise", "amax_columnwise")
    rowwise_rows = {"rowwise_data": (0, 1), "rowwise_scale_inv": (0, 1)}

    def _dims(self, shape):
        m, k = flat_dims(tuple(shape))
        return m, k, nx.ceil_div(m, BLOCK), k // BLOCK

    def buffer_specs(self, shape):
        m, k, mb, kb = self._dims(shape)
        return {
            "rowwise_data": ((m, k // 2), torch.uint8),
            "rowwise_scale_inv": ((nx.round_up(m, 128), nx.round_up(kb, 4)), torch.uint8),
            "columnwise_data": ((k, m // 2), torch.uint8),
            "columnwise_scale_inv": ((nx.round_up(k, 128), nx.round_up(mb, 4)), torch.uint8),
            "amax_rowwise": ((1,), torch.float32),
            "amax_columnwise": ((1,), torch.float32),
        }

    def valid_regions(self, shape):
        m, k, mb, kb = self._dims(shape)
        return {"rowwise_data": full((m, k // 2)), "rowwise_scale_inv": full((m, kb)),
                "columnwise_data": full((k, m // 2)), "columnwise_scale_inv": full((k, mb)),
                "amax_rowwise": full((1,)), "amax_columnwise": full((1,))}

    def _assemble(self, shape, row_data, row_scales, col_data, col_scales, amax_row, amax_col):
        """row_scales (M, K/16); col_data (K, M/2); col_scales (K, ceil(M/16))."""
        specs = self.buffer_specs(shape)
        return self._make(shape, {
            "rowwise_data": row_data,
            "rowwise_scale_inv": nx.padded_zeros(row_scales, specs["rowwise_scale_inv"][0]),
            "columnwise_data": col_data,
            "columnwise_scale_inv": nx.padded_zeros(col_scales, specs["columnwise_scale_inv"][0]),
            "amax_rowwise": amax_row.clone(),
            "amax_columnwise": amax_col.clone(),
        })

    def _dequant(self, packed, scales, amax):
        """float32 (R, C) from packed (R, C/2) codes and per-1x16 scale bits (R, C/16)."""
        return _blocks_dequantized(packed, scales, amax, nx.e2m1_pair_table(packed))

    def _dequantize(self, q):
        return _blocks_dequantized(*self._dequantize_parts(q)[1])

    def _dequantize_parts(self, q):
        b, v = q.buffers, q.valid
        packed = b["rowwise_data"]
        return _blocks_dequantized, (packed, b["rowwise_scale_inv"][v["rowwise_scale_inv"]], b["amax_rowwise"],
                                     nx.e2m1_pair_table(packed))

    def _dequantize_row_layout(self, rows, glob, shape):
        packed = rows["rowwise_data"]
        return _blocks_dequantized(packed, self._row_scales(rows["rowwise_scale_inv"], shape), glob["amax_rowwise"],
                                   nx.e2m1_pair_table(packed))

    def _row_scales(self, scales: torch.Tensor, shape) -> torch.Tensor:
        """The rowwise scale bits (M, K/16) `from_rows` lays out from the row layout's."""
        return scales

    def _dequantize_columnwise(self, q):
        m, k, mb, kb = self._dims(q.shape)
        b, v = q.buffers, q.valid
        data = b["columnwise_data"]  # (K, M/2)
        scales = b["columnwise_scale_inv"][v["columnwise_scale_inv"]]  # (K, ceil(M/16))
        pad_pairs = mb * BLOCK // 2 - data.shape[1]
        if pad_pairs:
            data = torch.nn.functional.pad(data, (0, pad_pairs))
        out_t = self._dequant(data, scales, b["amax_columnwise"])  # (K, Mp)
        return out_t[:, :m].t()

    @staticmethod
    def _codes(x_view: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        """E2M1 codes of x * enc (float32 product), x_view and enc broadcastable, codes x_view-shaped."""
        v = nx.as_float32(x_view)
        v.mul_(enc)
        return nx.e2m1_codes(v)


class Nvfp4_1DFormat(_Nvfp4Base):
    name = "nvfp4_1d"
    rows_per_entry = {"rowwise_data": 1, "rowwise_scale_inv": 1, "columnwise_data": 2,
                      "columnwise_scale_inv": BLOCK}

    def row_specs(self, shape):
        m, k, mb, kb = self._dims(shape)
        return {"rowwise_data": ((m, k // 2), torch.uint8), "rowwise_scale_inv": ((m, kb), torch.uint8),
                "columnwise_data": ((m // 2, k), torch.uint8),
                "columnwise_scale_inv": ((mb, k), torch.uint8)}

    def _quantize(self, x2, amax, shape):
        m, k, mb, kb = self._dims(shape)
        g_enc, g_dec = nx.nvfp4_global_scales(amax)
        # rowwise: 1x16 blocks along K
        xr = x2.view(m, kb, BLOCK)
        r_s, r_enc = nx.nvfp4_block_scales(nx.abs_amax(xr, dim=2), g_enc, g_dec)
        row_data = nx.pack_nibbles(self._codes(xr, r_enc.view(m, kb, 1)).view(m, k))
        # columnwise: 16x1 blocks along M (the 1x16 blocks of x^T), M zero-padded to 16
        xc = nx.pad2d(x2, mb * BLOCK, k).view(mb, BLOCK, k)
        c_s, c_enc = nx.nvfp4_block_scales(nx.abs_amax(xc, dim=1), g_enc, g_dec)
        codes = self._codes(xc, c_enc.view(mb, 1, k)).view(mb * BLOCK, k)
        col_data = nx.pack_nibbles_rows(codes).t()[:, : m // 2].contiguous()
        return self._assemble(shape, row_data, r_s, col_data, c_s.t(), amax, amax)

    def _to_rows(self, q):
        b, v = q.buffers, q.valid
        return ({"rowwise_data": b["rowwise_data"],
                 "rowwise_scale_inv": b["rowwise_scale_inv"][v["rowwise_scale_inv"]],
                 "columnwise_data": b["columnwise_data"].t(),
                 "columnwise_scale_inv": b["columnwise_scale_inv"][v["columnwise_scale_inv"]].t()},
                {"amax_rowwise": b["amax_rowwise"], "amax_columnwise": b["amax_columnwise"]})

    def _from_rows(self, rows, glob, shape):
        return self._assemble(shape, rows["rowwise_data"].contiguous(), rows["rowwise_scale_inv"],
                              rows["columnwise_data"].t().contiguous(),
                              rows["columnwise_scale_inv"].t(),
                              glob["amax_rowwise"], glob["amax_columnwise"])


class Nvfp4_2DFormat(_Nvfp4Base):
    name = "nvfp4_2d"
    rows_per_entry = {"rowwise_data": 1, "rowwise_scale_inv": 1}

    def row_specs(self, shape):
        m, k, mb, kb = self._dims(shape)
        return {"rowwise_data": ((m, k // 2), torch.uint8), "rowwise_scale_inv": ((m, kb), torch.uint8)}

    def _quantize(self, x2, amax, shape):
        m, k, mt, kt = self._dims(shape)
        g_enc, g_dec = nx.nvfp4_global_scales(amax)
        xp = nx.pad2d(x2, mt * BLOCK, k).view(mt, BLOCK, kt, BLOCK)
        tile_s, tile_enc = nx.nvfp4_block_scales(nx.abs_amax(xp, dim=(1, 3)), g_enc, g_dec)
        codes = self._codes(xp, tile_enc.view(mt, 1, kt, 1)).view(mt * BLOCK, k)
        return self._from_codes(shape, codes, tile_s, amax, amax)

    def _from_codes(self, shape, codes, tile_s, amax_row, amax_col):
        """codes (>= M rows, K) of the whole tensor, tile_s (Mt, Kt) tile scale bits."""
        m, k, mt, kt = self._dims(shape)
        row_data = nx.pack_nibbles(codes[:m])
        col_data = nx.pack_nibbles_rows(codes[:m]).t().contiguous()
        row_scales = tile_s.repeat_interleave(BLOCK, dim=0)[:m]
        col_scales = tile_s.t().repeat_interleave(BLOCK, dim=0)  # (K, Mt)
        return self._assemble(shape, row_data, row_scales, col_data, col_scales, amax_row, amax_col)

    def _to_rows(self, q):
        b, v = q.buffers, q.valid
        return ({"rowwise_data": b["rowwise_data"],
                 "rowwise_scale_inv": b["rowwise_scale_inv"][v["rowwise_scale_inv"]]},
                {"amax_rowwise": b["amax_rowwise"], "amax_columnwise": b["amax_columnwise"]})

    def _row_scales(self, scales, shape):
        m = flat_dims(tuple(shape))[0]
        return scales[::BLOCK].repeat_interleave(BLOCK, dim=0)[:m]  # each tile's first row, as _from_rows reads it

    def _from_rows(self, rows, glob, shape):
        codes = nx.unpack_nibbles(rows["rowwise_data"])  # (M, K)
        tile_s = rows["rowwise_scale_inv"][::BLOCK]  # first row of each 16-row tile: (Mt, Kt)
        return self._from_codes(shape, codes, tile_s, glob["amax_rowwise"], glob["amax_columnwise"])
