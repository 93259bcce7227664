"""A golden's row block dequantized in registers and compared with the library's values, by one
Triton kernel per format (for qgather.instruments.fused.count_differing_values): the block's values
never exist in memory, and the host pays one launch instead of a compiled function's call (a few
hundred microseconds each on an H200, five of them per inspection of a large weight).

Each kernel computes what the format's own dequantization (`Format.dequantize_rows_parts`) computes,
operation for operation in float32, so that its count is the eager comparison's: the fp8 codes'
float32 values are looked up in a table that torch's own conversion made (NaN payloads included),
then multiplied as the format multiplies them. tests/gpu/test_fused_compare.py checks the counts
against the eager comparison's; tests/test_fused_values.py runs the kernels in Triton's interpreter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from qgather.formats import fp8_block, nvfp4
from qgather.formats import numerics as nx

ROWS = 32  # rows per program; a divisor of fp8_block's 128-row scale tiles
FP8_COLUMNS = 128  # columns per program of the fp8_block kernel: one scale tile wide
NVFP4_BYTES = 128  # packed bytes (256 values, 16 scale blocks) per row of a program of the NVFP4 kernel


def count(got: torch.Tensor, fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Elements of `got` (float32, contiguous) whose bits differ from fn(*tensors), a 0-dim int64
    tensor on got's device, by the format's own kernel; None where `fn` has none, `got` is not a
    contiguous float32 tensor, Triton does not import, or offsets pass 32 bits."""
    launch = _LAUNCHERS.get(fn)
    if launch is None or got.dtype != torch.float32 or not got.is_contiguous() or got.dim() != 2 \
            or got.numel() >= 1 << 31:
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    return launch(kernels, got, *tensors)


def _count_fp8_tiles(kernels, got: torch.Tensor, data: torch.Tensor, tile_scale_inv: torch.Tensor) -> torch.Tensor:
    """fp8_block._tiles_dequantized(data, tile_scale_inv) against `got`."""
    rows, cols = got.shape
    if tuple(data.shape) != (rows, cols) or data.stride(1) != 1:
        raise ValueError(f"fp8 codes {tuple(data.shape)} (strides {data.stride()}) for values {tuple(got.shape)}")
    grid = (-(-rows // ROWS), -(-cols // FP8_COLUMNS))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=got.device)
    kernels.fp8_tiles[grid](got, data, tile_scale_inv, _fp8_values(got.device), partial, rows, cols,
                            data.stride(0), tile_scale_inv.stride(0), tile_scale_inv.stride(1),
                            ROWS=ROWS, COLUMNS=FP8_COLUMNS, TILE=fp8_block.BLOCK)
    return partial.sum(dtype=torch.int64)


def _count_nvfp4_blocks(kernels, got: torch.Tensor, packed: torch.Tensor, scale_bits: torch.Tensor,
                        amax: torch.Tensor, pair_table: torch.Tensor) -> torch.Tensor:
    """nvfp4._blocks_dequantized(packed, scale_bits, amax, pair_table) against `got`."""
    rows, cols = got.shape
    if tuple(packed.shape) != (rows, cols // 2) or packed.stride(1) != 1 or scale_bits.stride(1) != 1 \
            or not pair_table.is_contiguous() or amax.numel() != 1:
        raise ValueError(f"NVFP4 codes {tuple(packed.shape)} for values {tuple(got.shape)}")
    grid = (-(-rows // ROWS), -(-(cols // 2) // NVFP4_BYTES))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=got.device)
    kernels.nvfp4_blocks[grid](got, packed, scale_bits, amax, _nvfp4_inverse(got.device), pair_table,
                               _fp8_values(got.device), partial, rows, cols // 2, packed.stride(0),
                               scale_bits.stride(0), ROWS=ROWS, BYTES=NVFP4_BYTES, PAIRS=nvfp4.BLOCK // 2)
    return partial.sum(dtype=torch.int64)


_LAUNCHERS = {fp8_block._tiles_dequantized: _count_fp8_tiles, nvfp4._blocks_dequantized: _count_nvfp4_blocks}


@functools.cache
def _fp8_values(device: torch.device) -> torch.Tensor:
    """float32 values of the 256 E4M3 codes, as torch converts them (numerics.fp8_values)."""
    return nx.fp8_values(torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8), torch.float8_e4m3fn)


@functools.cache
def _nvfp4_inverse(device: torch.device) -> torch.Tensor:
    """fl32(1 / (6 * 448)), the constant of numerics.nvfp4_dequant_factor, rounded by torch as there."""
    return nx.f32(1.0 / (nx.FP4_E2M1_MAX * nx.FP8_E4M3_MAX), device)


@functools.cache
def _kernels():
    """The Triton kernels (fp8_tiles, nvfp4_blocks), or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def fp8_tiles(got_ptr, data_ptr, scale_ptr, values_ptr, out_ptr, rows, cols, data_row, scale_row, scale_col,
                  ROWS: tl.constexpr, COLUMNS: tl.constexpr, TILE: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        codes = tl.load(data_ptr + r[:, None] * data_row + c[None, :], mask=inside, other=0)
        # one scale per program: ROWS and COLUMNS divide the scale tile
        tile = tl.load(scale_ptr + (tl.program_id(0) * ROWS // TILE) * scale_row
                       + (tl.program_id(1) * COLUMNS // TILE) * scale_col)
        want = tl.load(values_ptr + codes.to(tl.int32)) * tile
        got = tl.load(got_ptr + r[:, None] * cols + c[None, :], mask=inside, other=0.0)
        differ = (got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)) & inside
        tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                 tl.sum(tl.sum(differ.to(tl.int32), axis=1), axis=0))

    @triton.jit
    def nvfp4_blocks(got_ptr, packed_ptr, scale_ptr, amax_ptr, inverse_ptr, pairs_ptr, values_ptr, out_ptr,
                     rows, nbytes, packed_row, scale_row, ROWS: tl.constexpr, BYTES: tl.constexpr,
                     PAIRS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        j = tl.program_id(1) * BYTES + tl.arange(0, BYTES)
        inside = (r[:, None] < rows) & (j[None, :] < nbytes)
        codes = tl.load(packed_ptr + r[:, None] * packed_row + j[None, :], mask=inside, other=0).to(tl.int32)
        scale_codes = tl.load(scale_ptr + r[:, None] * scale_row + j[None, :] // PAIRS, mask=inside, other=0)
        s = tl.load(values_ptr + scale_codes.to(tl.int32))
        amax = tl.load(amax_ptr)
        inverse = tl.load(inverse_ptr)
        product = s * amax
        # numerics.nvfp4_dequant_factor: where s * amax overflows, s * (amax * inverse)
        overflow = (product.to(tl.int32, bitcast=True) & 0x7FFFFFFF) == 0x7F800000
        factor = tl.where(overflow, s * (amax * inverse), product * inverse)
        low = tl.load(pairs_ptr + codes * 2) * factor
        high = tl.load(pairs_ptr + codes * 2 + 1) * factor
        at = r[:, None] * (nbytes * 2) + j[None, :] * 2
        got_low = tl.load(got_ptr + at, mask=inside, other=0.0)
        got_high = tl.load(got_ptr + at + 1, mask=inside, other=0.0)
        differ = ((got_low.to(tl.int32, bitcast=True) != low.to(tl.int32, bitcast=True)) & inside).to(tl.int32) \
            + ((got_high.to(tl.int32, bitcast=True) != high.to(tl.int32, bitcast=True)) & inside).to(tl.int32)
        tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                 tl.sum(tl.sum(differ, axis=1), axis=0))

    return SimpleNamespace(fp8_tiles=fp8_tiles, nvfp4_blocks=nvfp4_blocks)
