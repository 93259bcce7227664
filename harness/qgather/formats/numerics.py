"""Element-level numerics shared by the format modules (bit-exact with TransformerEngine 2.20.2).

Everything here is plain vectorized torch and works on any device. All arithmetic that decides a
bit pattern is done in float32 with IEEE round-to-nearest-even, in the same order as TE's kernels
or reference quantizers (see /work/shared/docs/formats.md):

- E4M3 / E5M2: torch's float32 -> float8 casts round to nearest even; values are clamped to
  +-fp8_max first where they can exceed it, which matches the kernels' saturating (satfinite) casts.
- E2M1 (NVFP4 elements): TE's reference bins, ties to the even code (see `e2m1_codes`).
- E8M0 (MXFP8 scales): TE's `float_to_e8m0` (round up to a power of two) and `exp2f_rcp`.
- Power-of-two FP8 block scales: TE's `ComputeScale` (mantissa bits masked off).
"""

from __future__ import annotations

import functools

import torch

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
FP4_E2M1_MAX = 6.0
F32_MAX = float(torch.finfo(torch.float32).max)

#: The 16 values of an E2M1 nibble (codes 8..15 are the negatives of 0..7; code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

#: E2M1 rounding bins on |v|: (threshold, strict). |v| > t (strict) or |v| >= t adds one to the
#: code. Strict thresholds send ties down, the others up: both are "ties to the even code".
E2M1_BINS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False),
             (5.0, True))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """Smallest multiple of b that is >= a."""
    return ceil_div(a, b) * b


def f32(value: float, device: torch.device | str | None = None) -> torch.Tensor:
    """A float32 tensor of shape (1,) (one dim, so that it promotes bf16 operands to float32)."""
    return torch.tensor([value], dtype=torch.float32, device=device)


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """A float32 copy of x that the caller owns (always a new tensor, safe to modify in place)."""
    if x.dtype == torch.float32:
        return x.clone(memory_format=torch.contiguous_format)
    return x.to(torch.float32, memory_format=torch.contiguous_format)


def pad2d(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x (2-D) zero-padded at the bottom/right to (rows, cols); x itself when no padding is needed."""
    m, k = x.shape
    if m == rows and k == cols:
        return x
    return torch.nn.functional.pad(x, (0, cols - k, 0, rows - m))


def padded_zeros(src: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A zero tensor of `shape` (src's dtype/device) whose top-left corner is src."""
    out = torch.zeros(shape, dtype=src.dtype, device=src.device)
    out[: src.shape[0], : src.shape[1]] = src
    return out


def abs_amax(x: torch.Tensor, dim) -> torch.Tensor:
    """max |x| over `dim` (exact in x's dtype), returned as float32 (+0.0, never -0.0)."""
    return torch.maximum(torch.amax(x, dim=dim), -torch.amin(x, dim=dim)).to(torch.float32) + 0.0


def global_abs_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| of the whole tensor as a float32 (1,) tensor (+0.0 for an empty or all-zero tensor);
    NaN propagates."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, -lo).to(torch.float32).reshape(1) + 0.0


# --------------------------------------------------------------------------------------------
# FP8 (E4M3 / E5M2)


def fp8_bits(v: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float | None = None) -> torch.Tensor:
    """uint8 bits of v (float32) cast to fp8 with round-to-nearest-even.

    With fp8_max given, v is first clamped IN PLACE to +-fp8_max (the saturating cast of TE's
    kernels); pass None only where |v| provably cannot exceed fp8_max by a rounding margin.
    """
    if fp8_max is not None:
        v.clamp_(-fp8_max, fp8_max)
    return v.to(fp8_dtype).view(torch.uint8)


def fp8_values(bits: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32 values of uint8 fp8 bits."""
    return bits.view(fp8_dtype).to(torch.float32)


def current_scale(amax: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling (TE `compute_scale_from_amax`, epsilon 0, no pow-2).

    scale = fp8_max / amax; amax == 0 -> 1; an infinite scale (tiny amax) -> float32 max.
    Returns (scale, scale_inv), float32 tensors shaped like amax.
    """
    scale = torch.div(f32(fp8_max, amax.device), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, F32_MAX), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale, torch.div(f32(1.0, amax.device), scale)


def pow2_block_scale(amax: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 block scaling with power-of-two scales (TE `ComputeScale<..., Power2Scaling=true>`).

    scale = 2^floor(log2(fp8_max / amax)) computed by masking the mantissa of the float32
    quotient; amax == 0 -> 1; an infinite quotient -> 2^127. Returns (scale, scale_inv).
    """
    scale = torch.div(f32(fp8_max, amax.device), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, 2.0 ** 127), scale)
    scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale, torch.div(f32(1.0, amax.device), scale)


# --------------------------------------------------------------------------------------------
# E8M0 (MXFP8 scales)


def e8m0_from_amax(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Biased E8M0 exponent (uint8) of the smallest power of two >= amax * fl32(1 / fp8_max).

    TE multiplies by the float32 reciprocal of fp8_max (`Quantized_Limits::max_norm_rcp`) and
    rounds the product up to a power of two (`float_to_e8m0`); products <= 2^-127 (incl. 0) -> 0,
    products above 2^127 saturate to 254.
    """
    val = amax.to(torch.float32) * f32(1.0 / fp8_max, amax.device)
    bits = val.view(torch.int32)
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    return (exp + up.to(torch.int32)).to(torch.uint8)


def e8m0_quant_scale(code: torch.Tensor) -> torch.Tensor:
    """float32 multiplier applied before the FP8 cast: 2^(127 - code); code 0 -> 1 (TE `exp2f_rcp`)."""
    c = code.to(torch.int32)
    s = ((254 - c) << 23).view(torch.float32)
    return torch.where(c == 0, torch.ones_like(s), s)


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """float32 value of an E8M0 code, 2^(code - 127), computed as TE's `exp2f` (code 0 -> 0.0; the
    data of such a block is all zero anyway)."""
    return (code.to(torch.int32) << 23).view(torch.float32)


# --------------------------------------------------------------------------------------------
# E2M1 (NVFP4 elements)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, 0..15) of float32 v, as TE's reference `cast_to_fp4x2` bins them.

    Bins on |v|: <= .25 -> 0, < .75 -> 1, <= 1.25 -> 2, < 1.75 -> 3, <= 2.5 -> 4, < 3.5 -> 5,
    <= 5 -> 6, else 7 (|v| > 6 saturates to 7, like a clamp to +-6). v < 0 adds the sign bit (8),
    so negatives that round to zero give code 8 (-0) while v == -0.0 gives code 0.

    v is OVERWRITTEN with |v| (the caller passes a temporary it owns).
    """
    codes = torch.empty(v.shape, dtype=torch.uint8, device=v.device)
    flag = torch.empty(v.shape, dtype=torch.bool, device=v.device)
    torch.lt(v, 0.0, out=flag)
    torch.mul(flag.view(torch.uint8), 8, out=codes)
    v.abs_()
    for threshold, strict in E2M1_BINS:
        (torch.gt if strict else torch.ge)(v, threshold, out=flag)
        codes.add_(flag.view(torch.uint8))
    return codes


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8 0..15)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.to(torch.int64)]


def e2m1_pair_values(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of packed E2M1 codes, (..., n) uint8 -> (..., 2n), the low nibble first
    (pack_nibbles): e2m1_values(unpack_nibbles(packed)) in one lookup of each byte's two values,
    without the unpacked codes or 8-byte indices (a large weight's temporaries)."""
    return e2m1_pairs_looked_up(packed, e2m1_pair_table(packed))


def e2m1_pairs_looked_up(packed: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """e2m1_pair_values with the (256, 2) table given (a function of tensors alone)."""
    pairs = torch.nn.functional.embedding(packed.to(torch.int32), table)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_pair_table(like: torch.Tensor) -> torch.Tensor:
    """(256, 2) float32 on `like`'s device: each byte's low-nibble and high-nibble E2M1 values.
    Built where it is used (no copy from the host to wait for); kept per GPU only for plain
    tensors, since a kept tensor must not meet a compiler's fake ones."""
    if like.device.type == "cuda" and type(like) is torch.Tensor:
        return _kept_pair_table(like.device)
    return _pair_table(like.device)


@functools.cache
def _kept_pair_table(device: torch.device) -> torch.Tensor:
    return _pair_table(device)


def _pair_table(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":  # from the 16 values: faster there than the dozen small operations below
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        return torch.stack((values.repeat(16), values.repeat_interleave(16)), dim=-1)
    byte = torch.arange(256, dtype=torch.int32, device=device)
    return torch.stack((_e2m1_of(byte & 15), _e2m1_of(byte >> 4)), dim=-1)


def _e2m1_of(code: torch.Tensor) -> torch.Tensor:
    """float32 values of int32 E2M1 codes: s ee m -> (-1)^s * (e ? 2^(e-1) * (1 + m/2) : m/2)."""
    exponent, mantissa = (code >> 1) & 3, (code & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa * 0.5,
                            torch.exp2((exponent - 1).to(torch.float32)) * (1.0 + mantissa * 0.5))
    return torch.where(code >= 8, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack pairs along the last dim: element 2c -> low nibble, 2c+1 -> high nibble of byte c."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return torch.add(pairs[..., 0], pairs[..., 1], alpha=16)


def pack_nibbles_rows(codes: torch.Tensor) -> torch.Tensor:
    """Pack pairs of rows of a 2-D code tensor: row 2r -> low nibble, 2r+1 -> high; (M, K) -> (M/2, K)."""
    pairs = codes.reshape(codes.shape[0] // 2, 2, codes.shape[1])
    return torch.add(pairs[:, 0], pairs[:, 1], alpha=16)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: (..., n) uint8 -> (..., 2n) codes."""
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# --------------------------------------------------------------------------------------------
# NVFP4 scale arithmetic (float32, in the order of TE's reference quantizer)


def nvfp4_global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_enc, g_dec): g_enc = min(448 * 6 / amax, f32 max), 1 if that is 0; g_dec = 1 / g_enc."""
    dev = amax.device
    g_enc = torch.div(f32(FP8_E4M3_MAX * FP4_E2M1_MAX, dev), amax)
    g_enc = torch.minimum(g_enc, f32(F32_MAX, dev))
    g_enc = torch.where(g_enc == 0, torch.ones_like(g_enc), g_enc)
    return g_enc, torch.div(f32(1.0, dev), g_enc)


def nvfp4_block_scales(block_amax: torch.Tensor, g_enc: torch.Tensor,
                       g_dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block (E4M3 scale bits uint8, float32 encode multiplier) from float32 block amaxes.

    s = e4m3(clamp(min(block_amax * (g_enc * fl32(1/6)), f32 max), -448, 448));
    enc = min(1 / (float(s) * g_dec), f32 max).
    """
    dev = block_amax.device
    mult = g_enc * f32(1.0 / FP4_E2M1_MAX, dev)  # fl32(1/6), as torch.reciprocal(6.0) in TE
    s = torch.minimum(block_amax * mult, f32(F32_MAX, dev))
    s = torch.clamp(s, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    enc = torch.minimum(torch.div(f32(1.0, dev), s.to(torch.float32) * g_dec), f32(F32_MAX, dev))
    return s.view(torch.uint8), enc


def nvfp4_dequant_factor(scale_bits: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """float32 per-block factor of TE's NVFP4 dequantize kernel: (float(s) * amax) * fl32(1/(6*448)).

    Where float(s) * amax overflows (amax near the float32 max: TE's kernel returns inf/NaN there),
    float(s) * (amax * fl32(1/(6*448))) is used instead, so that dequantize stays finite.
    """
    s = fp8_values(scale_bits, torch.float8_e4m3fn)
    inv = f32(1.0 / (FP4_E2M1_MAX * FP8_E4M3_MAX), amax.device)
    prod = s * amax
    return torch.where(torch.isinf(prod), s * (amax * inv), prod * inv)
