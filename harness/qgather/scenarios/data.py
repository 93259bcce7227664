"""Deterministic test data of a case: its master weight, the gradients of its optimizer steps and
the layer input, the same on every rank (drawn from the case seed).

The weight's rows grow in magnitude by ~2^12 from first to last (`row_scales`), so that shards have
very different amaxes and a per-rank scale (bug class 6) cannot go unnoticed.
"""

from __future__ import annotations

import math

import torch

from qgather.model.case import CaseSpec

INPUT_ROWS = 8

#: Weights up to this many elements come from torch's CPU generator, identical on every rank and machine
#: (the stored goldens and every known-issue entry are defined by them). Larger ones (the GPU benchmark's
#: 8192x28672) are drawn on the rank's device: torch's CPU generator alone takes seconds for them. A
#: device's generator gives every rank of one run the same weight (same seed, same GPU model); a CPU run
#: and a GPU run of such a case hold different weights.
LARGE_WEIGHT = 1 << 22
#: A large weight on a device is drawn in row blocks of about this many elements (the last may be shorter),
#: each drawn in float32 and rounded straight into the weight. 16 Mi elements: the float32 temporary is
#: 64 MiB, small next to the benchmark's 448 MiB bf16 weight (whose peak-memory goal is 3x that), and a
#: rank that draws only its shard's rows draws at most one block's worth beyond them at each end; 15
#: blocks of 8192x28672 cost a few dozen launches. The block size is part of the values: each block
#: has its own generator (`block_seed`), so another size cuts the weight into other streams.
DRAW_BLOCK_ELEMENTS = 1 << 24
#: `block_seed`'s stride: block seeds of one case seed are `seed * BLOCK_SEED_STRIDE + index`, distinct
#: from every other (seed, index) pair while index < BLOCK_SEED_STRIDE.
BLOCK_SEED_STRIDE = 1 << 20

Rows = tuple[int, int]  # [start, stop) along the weight's first dimension


def _generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def block_seed(seed: int, index: int) -> int:
    """The generator seed of row block `index` of a blockwise draw of `seed`: any block can be drawn
    alone and holds the values the full draw gives it."""
    if not 0 <= index < BLOCK_SEED_STRIDE:
        raise ValueError(f"row block {index} is outside [0, {BLOCK_SEED_STRIDE}): its seed would collide")
    return seed * BLOCK_SEED_STRIDE + index


def draws_blockwise(spec: CaseSpec, device: torch.device | str | None) -> bool:
    """Whether `spec`'s weight on `device` is drawn blockwise (large, and not on the CPU), so that
    drawing only some rows (`make_weight`'s `rows`) costs only the blocks they touch."""
    return math.prod(spec.shape) > LARGE_WEIGHT and torch.device(device or "cpu").type != "cpu"


def _randn_scaled(spec: CaseSpec, seed: int, device: torch.device | str | None, dtype: torch.dtype,
                  rows: Rows | None = None) -> torch.Tensor:
    """randn(shape) * row_scales, in `dtype` (each value rounded once, from float32); with `rows`,
    only those rows, the others NaN."""
    if draws_blockwise(spec, device):
        return _draw_blockwise(spec, seed, torch.device(device), dtype, rows)
    values = torch.randn(spec.shape, generator=_generator(seed)) * row_scales(spec)
    values = values.to(device=device or "cpu", dtype=dtype)
    if rows is not None:  # the CPU generator's one stream is drawn whole: the other rows are set aside
        _fill_outside(values, rows)
    return values


def _draw_blockwise(spec: CaseSpec, seed: int, device: torch.device, dtype: torch.dtype, rows: Rows | None = None,
                    block_elements: int = DRAW_BLOCK_ELEMENTS) -> torch.Tensor:
    """`_randn_scaled` in row blocks of about `block_elements`, block i from its own generator
    (`block_seed(seed, i)`); with `rows`, only the blocks that hold some of them are drawn."""
    out = torch.empty(spec.shape, dtype=dtype, device=device)
    start, stop = _clamped(rows, spec.shape[0])
    step = max(1, block_elements // max(1, math.prod(spec.shape[1:])))
    scales = row_scales(spec, device)
    for index in _blocks_holding(start, stop, step):
        first = index * step
        block = torch.randn((min(step, spec.shape[0] - first), *spec.shape[1:]),
                            generator=_generator(block_seed(seed, index), device), device=device)
        lo, hi = max(first, start), min(first + step, stop)
        torch.mul(block[lo - first:hi - first], scales[lo:hi], out=out[lo:hi])  # the product rounded once
    _fill_outside(out, (start, stop))
    return out


def _blocks_holding(start: int, stop: int, step: int) -> range:
    """The indices of the blocks of `step` rows that hold some of the rows [start, stop)."""
    return range(start // step, -(-stop // step)) if start < stop else range(0)


def _clamped(rows: Rows | None, length: int) -> Rows:
    start, stop = (0, length) if rows is None else rows
    if not 0 <= start <= stop <= length:
        raise ValueError(f"rows [{start}, {stop}) are not within the weight's {length}")
    return start, stop


def _fill_outside(values: torch.Tensor, rows: Rows) -> None:
    """NaN in every row outside `rows`: what reads them by mistake fails, rather than finding
    uninitialized memory that may hold an identical weight an earlier case left."""
    start, stop = _clamped(rows, values.shape[0])
    values[:start] = math.nan
    values[stop:] = math.nan


def row_scales(spec: CaseSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """Magnitudes that differ by ~2^12 from the first to the last rows, so shards have very
    different amaxes and a per-rank scale (bug class 6) cannot go unnoticed."""
    exponents = torch.linspace(-6.0, 6.0, spec.shape[0])
    return torch.exp2(exponents).reshape(-1, *([1] * (len(spec.shape) - 1))).to(device or "cpu")


def make_weight(spec: CaseSpec, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32, rows: Rows | None = None) -> torch.Tensor:
    """The master weight (default float32; `dtype`: the same values rounded to it) on `device`
    (default the CPU), identical on every rank. rows: only the rows [start, stop) of the first
    dimension hold the weight's values (bit for bit those of the full draw), every other row is NaN;
    a blockwise draw (`draws_blockwise`) then draws only the blocks that hold them."""
    return _randn_scaled(spec, spec.seed, device, dtype, rows)


def make_gradient(spec: CaseSpec, step: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The gradient of optimizer step `step` (1, 2, ...) for the full weight, float32, identical on every rank."""
    return _randn_scaled(spec, spec.seed * 1000 + step, device, torch.float32)


def make_input(spec: CaseSpec) -> torch.Tensor:
    """The layer input: INPUT_ROWS rows of the weight's K, float32, on the CPU."""
    return torch.randn((INPUT_ROWS, spec.shape[-1]), generator=_generator(spec.seed + 7))
