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
from qgather.instruments import kernels

ROWS = 32  # rows per program; a divisor of fp8_block's 128-row scale tiles
FP8_COLUMNS = 128  # columns per program of the fp8_block kernel: one scale tile wide
#: 1x16 scale blocks (128 values) per row of a program of the NVFP4 kernel: 78 us per 48 Mi-element block
#: on an H200 (16 blocks: 86 us; the fp8_block kernel: 90 us, whatever the program's shape)
NVFP4_SCALE_BLOCKS = 8


def count(got: torch.Tensor, fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Elements of `got` (float32, contiguous) whose bits differ from fn(*tensors), a 0-dim int64
    tensor on got's device, by the format's own kernel; None where `fn` has none, `got` is not a
    contiguous float32 tensor, Triton does not import, or offsets pass 32 bits."""
    launch = _LAUNCHERS.get(fn)
    if launch is None or got.dtype != torch.float32 or not got.is_contiguous() or got.dim() != 2 \
            or got.numel() >= 1 << 31:
        return None
    triton = _kernels()
    if triton is None:
        return None
    return launch(triton, got, *tensors)


def _count_fp8_tiles(triton, got: torch.Tensor, data: torch.Tensor, tile_scale_inv: torch.Tensor
                     ) -> torch.Tensor | None:
    """fp8_block._tiles_dequantized(data, tile_scale_inv) against `got`."""
    rows, cols = got.shape
    tiles = (-(-rows // fp8_block.BLOCK), -(-cols // fp8_block.BLOCK))
    if tuple(data.shape) != (rows, cols) or data.stride(1) != 1 or tuple(tile_scale_inv.shape) != tiles:
        return None  # the kernel reads one scale per tile, unmasked: only a whole tile grid of them
    grid = (-(-rows // ROWS), -(-cols // FP8_COLUMNS))
    return kernels.counted(triton.fp8_tiles, grid, got.device, got, data, tile_scale_inv, _fp8_values(got.device),
                           rows, cols, data.stride(0), tile_scale_inv.stride(0), tile_scale_inv.stride(1),
                           ROWS=ROWS, COLUMNS=FP8_COLUMNS, TILE=fp8_block.BLOCK)


def _count_nvfp4_blocks(triton, got: torch.Tensor, packed: torch.Tensor, scale_bits: torch.Tensor,
                        amax: torch.Tensor, pair_table: torch.Tensor) -> torch.Tensor | None:
    """nvfp4._blocks_dequantized(packed, scale_bits, amax, pair_table) against `got`. The codes' values
    are decoded from their bits in the kernel (no table gathers), and each is checked against the
    pair table the format looks them up in (`_pair_table_is_e2m1`)."""
    rows, cols = got.shape
    blocks = cols // nvfp4.BLOCK
    if tuple(packed.shape) != (rows, cols // 2) or cols % nvfp4.BLOCK or packed.stride(1) != 1 \
            or tuple(scale_bits.shape) != (rows, blocks) or scale_bits.stride(1) != 1 or amax.numel() != 1 \
            or not _pair_table_is_e2m1(pair_table):
        return None
    grid = (-(-rows // ROWS), -(-blocks // NVFP4_SCALE_BLOCKS))
    return kernels.counted(triton.nvfp4_blocks, grid, got.device, got, packed, scale_bits, amax,
                           _nvfp4_inverse(got.device), _fp8_values(got.device), rows, blocks, packed.stride(0),
                           scale_bits.stride(0), ROWS=ROWS, BLOCKS=NVFP4_SCALE_BLOCKS, PAIRS=nvfp4.BLOCK // 2)


def _pair_table_is_e2m1(pair_table: torch.Tensor) -> bool:
    """Whether `pair_table` holds, bit for bit, the E2M1 values the kernel decodes (numerics.E2M1_VALUES
    of each byte's low and high nibble). Checked once per table: the format keeps one per GPU, held
    here with its answer so that no other tensor can come to share its address."""
    for table, answer in _CHECKED_TABLES:
        if table is pair_table:
            return answer
    want = nx.e2m1_pair_table(torch.empty(0, dtype=torch.uint8))
    answer = pair_table.shape == want.shape and pair_table.dtype == torch.float32 and bool(
        torch.equal(pair_table.detach().cpu().view(torch.int32), want.view(torch.int32)))
    _CHECKED_TABLES.insert(0, (pair_table, answer))
    del _CHECKED_TABLES[_KEPT_TABLES:]
    return answer


_KEPT_TABLES = 4
_CHECKED_TABLES: list[tuple[torch.Tensor, bool]] = []


_LAUNCHERS = {fp8_block._tiles_dequantized: _count_fp8_tiles, nvfp4._blocks_dequantized: _count_nvfp4_blocks}


@functools.cache
def _fp8_values(device: torch.device) -> torch.Tensor:
    """float32 values of the 256 E4M3 codes, as torch converts them (numerics.fp8_values)."""
    return nx.fp8_values(torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8), torch.float8_e4m3fn)


@functools.cache
def _nvfp4_inverse(device: torch.device) -> torch.Tensor:
    """fl32(1 / (6 * 448)), the constant of numerics.nvfp4_dequant_factor, rounded by torch as there."""
    return nx.f32(1.0 / (nx.FP4_E2M1_MAX * nx.FP8_E4M3_MAX), device)


def _value_kernels(triton, tl) -> SimpleNamespace:
    """The Triton kernels of `count` (fp8_tiles, nvfp4_blocks)."""

    @triton.jit
    def fp8_tiles(out_ptr, got_ptr, data_ptr, scale_ptr, values_ptr, rows, cols, data_row, scale_row, scale_col,
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
        tl.atomic_add(out_ptr, tl.sum(tl.sum(differ.to(tl.int32), axis=1), axis=0).to(tl.int64), sem="relaxed")

    @triton.jit
    def nvfp4_blocks(out_ptr, got_ptr, packed_ptr, scale_ptr, amax_ptr, inverse_ptr, values_ptr,
                     rows, blocks, packed_row, scale_row, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
                     PAIRS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        scale_codes = tl.load(scale_ptr + r[:, None] * scale_row + b[None, :],
                              mask=(r[:, None] < rows) & (b[None, :] < blocks), other=0)
        s = tl.load(values_ptr + scale_codes.to(tl.int32))  # (ROWS, BLOCKS): one factor per scale block
        amax = tl.load(amax_ptr)
        inverse = tl.load(inverse_ptr)
        product = s * amax
        # numerics.nvfp4_dequant_factor: where s * amax overflows, s * (amax * inverse)
        overflow = (product.to(tl.int32, bitcast=True) & 0x7FFFFFFF) == 0x7F800000
        factor = tl.where(overflow, s * (amax * inverse), product * inverse)
        factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (ROWS, BLOCKS, PAIRS)), (ROWS, BLOCKS * PAIRS))
        j = tl.program_id(1) * BLOCKS * PAIRS + tl.arange(0, BLOCKS * PAIRS)  # packed bytes
        inside = (r[:, None] < rows) & (j[None, :] < blocks * PAIRS)
        codes = tl.load(packed_ptr + r[:, None] * packed_row + j[None, :], mask=inside, other=0).to(tl.int32)
        # each nibble s ee m as float32 bits: (-1)^s * (ee ? 2^(ee-1) * (1 + m/2) : m/2), numerics._e2m1_of
        nibbles = tl.join(codes & 15, codes >> 4)  # (ROWS, BYTES, 2): the low nibble first
        exponent, mantissa = (nibbles >> 1) & 3, nibbles & 1
        bits = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
        low, high = tl.split((bits | ((nibbles >> 3) << 31)).to(tl.float32, bitcast=True))
        want = tl.interleave(low * factor, high * factor)  # element 2j: the low nibble
        c = tl.program_id(1) * BLOCKS * PAIRS * 2 + tl.arange(0, BLOCKS * PAIRS * 2)
        inside = (r[:, None] < rows) & (c[None, :] < blocks * PAIRS * 2)
        got = tl.load(got_ptr + r[:, None] * (blocks * PAIRS * 2) + c[None, :], mask=inside, other=0.0)
        differ = (got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)) & inside
        tl.atomic_add(out_ptr, tl.sum(tl.sum(differ.to(tl.int32), axis=1), axis=0).to(tl.int64), sem="relaxed")

    return SimpleNamespace(fp8_tiles=fp8_tiles, nvfp4_blocks=nvfp4_blocks)


_kernels = kernels.built(_value_kernels)
