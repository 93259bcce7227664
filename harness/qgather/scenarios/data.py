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
#: A large weight is drawn on its device in float32 blocks of about this many elements (256 MiB),
#: each rounded straight into the weight: a few launches, and the float32 draw never at full size.
#: The block size is part of the values: the generator's stream is cut where the blocks are.
DRAW_BLOCK_ELEMENTS = 1 << 26


def _generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn_scaled(spec: CaseSpec, seed: int, device: torch.device | str | None, dtype: torch.dtype) -> torch.Tensor:
    """randn(shape) * row_scales, in `dtype` (each value rounded once, from float32)."""
    device = torch.device(device or "cpu")
    if math.prod(spec.shape) <= LARGE_WEIGHT or device.type == "cpu":
        values = torch.randn(spec.shape, generator=_generator(seed)) * row_scales(spec)
        return values.to(device=device, dtype=dtype)
    # Row by row blocks from one device generator: the float32 draw never exists at full size.
    out = torch.empty(spec.shape, dtype=dtype, device=device)
    generator, scales = _generator(seed, device), row_scales(spec, device)
    step = max(1, DRAW_BLOCK_ELEMENTS // max(1, math.prod(spec.shape[1:])))
    for start in range(0, spec.shape[0], step):
        rows = out[start:start + step]
        block = torch.randn(rows.shape, generator=generator, device=device)
        torch.mul(block, scales[start:start + step], out=rows)  # the product rounded once, into the weight
    return out


def row_scales(spec: CaseSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """Magnitudes that differ by ~2^12 from the first to the last rows, so shards have very
    different amaxes and a per-rank scale (bug class 6) cannot go unnoticed."""
    exponents = torch.linspace(-6.0, 6.0, spec.shape[0])
    return torch.exp2(exponents).reshape(-1, *([1] * (len(spec.shape) - 1))).to(device or "cpu")


def make_weight(spec: CaseSpec, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The master weight (default float32; `dtype`: the same values rounded to it) on `device`
    (default the CPU), identical on every rank."""
    return _randn_scaled(spec, spec.seed, device, dtype)


def make_gradient(spec: CaseSpec, step: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The gradient of optimizer step `step` (1, 2, ...) for the full weight, float32, identical on every rank."""
    return _randn_scaled(spec, spec.seed * 1000 + step, device, torch.float32)


def make_input(spec: CaseSpec) -> torch.Tensor:
    """The layer input: INPUT_ROWS rows of the weight's K, float32, on the CPU."""
    return torch.randn((INPUT_ROWS, spec.shape[-1]), generator=_generator(spec.seed + 7))
