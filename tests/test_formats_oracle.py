"""qgather.formats against an independent, slow, per-block oracle written from docs/formats.md.

The oracle uses numpy float32 scalar/array arithmetic (IEEE single, round to nearest even), its own
FP8 rounding (nearest value of an enumerated code table, ties to the even code, so torch's float8
casts are checked too), log2/frexp-based power-of-two scales instead of bit masks, and the
16 interval rules of TE's reference `cast_to_fp4x2` for E2M1. It loops over blocks in Python, so
it is only run on small tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qgather.formats import FORMATS

F32 = np.float32
np.seterr(over="ignore")
FMAX = F32(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- fp8 rounding


def fp8_table(kind: str) -> np.ndarray:
    """Non-negative finite values of E4M3 (codes 0..0x7E) or E5M2 (codes 0..0x7B), by code."""
    vals = []
    if kind == "e4m3":
        for code in range(0x7F):
            e, m = code >> 3, code & 7
            vals.append(m * 2.0 ** -9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))
    else:
        for code in range(0x7C):
            e, m = code >> 2, code & 3
            vals.append(m * 2.0 ** -16 if e == 0 else 2.0 ** (e - 15) * (1 + m / 4))
    return np.array(vals, dtype=np.float64)


TABLES = {"e4m3": fp8_table("e4m3"), "e5m2": fp8_table("e5m2")}


def fp8_round(v: np.ndarray, kind: str = "e4m3") -> np.ndarray:
    """uint8 codes of float32 values v: nearest table value, ties to the even code, saturated to the
    largest finite value; the sign bit follows v's sign (so -0.0 -> 0x80)."""
    table = TABLES[kind]
    a = np.minimum(np.abs(v.astype(np.float64)), table[-1])
    hi = np.clip(np.searchsorted(table, a), 0, len(table) - 1)
    lo = np.clip(hi - 1, 0, len(table) - 1)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return code | (np.signbit(v).astype(np.uint8) << 7)


def fp8_value(code: int, kind: str = "e4m3") -> float:
    v = TABLES[kind][code & 0x7F]
    return -v if code & 0x80 else v


# ----------------------------------------------------------------------------- oracles


def f32_div(a, b) -> np.float32:
    with np.errstate(divide="ignore", over="ignore"):
        return F32(a) / F32(b)


def pow2_scale(amax: np.float32) -> np.float32:
    """2^floor(log2(448/amax)) via frexp; amax 0 -> 1; an infinite quotient -> f32 max -> 2^127."""
    if amax == 0:
        return F32(1.0)
    q = f32_div(448.0, amax)
    if np.isinf(q):
        q = FMAX
    _, e = math.frexp(float(q))  # q = m * 2^e, m in [0.5, 1)
    return F32(2.0 ** (e - 1))


def oracle_fp8_tensor(x: np.ndarray, kind: str, fp8_max: float):
    amax = F32(np.abs(x).max()) if x.size else F32(0)
    scale = f32_div(fp8_max, amax)
    if np.isinf(scale):
        scale = FMAX
    if amax == 0:
        scale = F32(1)
    v = np.clip(x * scale, -fp8_max, fp8_max)
    return {"data": fp8_round(v, kind), "scale_inv": np.array([f32_div(1, scale)], dtype=F32)}


def oracle_block_quant(x: np.ndarray, br: int, bc: int):
    """Blocks of br x bc (edge blocks partial): (data codes, scale_inv per block)."""
    m, k = x.shape
    data = np.zeros((m, k), dtype=np.uint8)
    sinv = np.zeros((math.ceil(m / br), math.ceil(k / bc)), dtype=F32)
    for i in range(sinv.shape[0]):
        for j in range(sinv.shape[1]):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scale = pow2_scale(F32(np.abs(blk).max()))
            sinv[i, j] = f32_div(1, scale)
            data[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = fp8_round(blk * scale)
    return data, sinv


def oracle_fp8_block(x):
    data, sinv = oracle_block_quant(x, 128, 128)
    return {"rowwise_data": data, "rowwise_scale_inv": sinv, "columnwise_data": data.T,
            "columnwise_scale_inv": sinv.T}


def oracle_fp8_block_1x128(x):
    rd, rs = oracle_block_quant(x, 1, 128)  # rs (M, Kb)
    cd, cs = oracle_block_quant(x, 128, 1)  # cs (Mb, K)
    return {"rowwise_data": rd, "rowwise_scale_inv": rs.T, "columnwise_data": cd.T,
            "columnwise_scale_inv": cs}


def e8m0(amax: np.float32) -> int:
    val = F32(amax) * F32(1.0 / 448.0)
    if val == 0:
        return 0
    mant, e = math.frexp(float(val))
    p = e - 1 if mant == 0.5 else e  # smallest power of two >= val is 2^p
    return int(min(max(p + 127, 0), 254))


def oracle_mxfp8_dir(x, br, bc):
    m, k = x.shape
    data = np.zeros((m, k), dtype=np.uint8)
    codes = np.zeros((m // br, k // bc), dtype=np.uint8)
    for i in range(m // br):
        for j in range(k // bc):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            c = e8m0(F32(np.abs(blk).max()))
            codes[i, j] = c
            mult = F32(1.0) if c == 0 else F32(2.0 ** (127 - c))
            data[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = fp8_round(blk * mult)
    return data, codes


def oracle_mxfp8(x):
    rd, rc = oracle_mxfp8_dir(x, 1, 32)
    cd, cc = oracle_mxfp8_dir(x, 32, 1)
    return {"rowwise_data": rd, "rowwise_scale_inv": rc, "columnwise_data": cd, "columnwise_scale_inv": cc}


def fp4_code(v: np.ndarray) -> np.ndarray:
    """TE reference cast_to_fp4x2 bins (the 16 interval rules), elementwise."""
    r = np.zeros(v.shape, dtype=np.uint8)
    rules = [
        ((v > 0.25) & (v < 0.75), 1), ((v >= 0.75) & (v <= 1.25), 2), ((v > 1.25) & (v < 1.75), 3),
        ((v >= 1.75) & (v <= 2.5), 4), ((v > 2.5) & (v < 3.5), 5), ((v >= 3.5) & (v <= 5.0), 6),
        (v > 5.0, 7), ((v >= -0.25) & (v < -0.0), 8), ((v < -0.25) & (v > -0.75), 9),
        ((v <= -0.75) & (v >= -1.25), 10), ((v < -1.25) & (v > -1.75), 11),
        ((v <= -1.75) & (v >= -2.5), 12), ((v < -2.5) & (v > -3.5), 13), ((v <= -3.5) & (v >= -5.0), 14),
        (v < -5.0, 15),
    ]
    for mask, code in rules:
        r[mask] = code
    return r


def oracle_nvfp4_dir(x: np.ndarray, amax: np.float32, tile_rows: int):
    """Rows of x quantized in 1x16 (tile_rows=1) or 16x16 blocks: codes (M, K), scales per row."""
    m, k = x.shape
    g_enc = min(f32_div(2688.0, amax), FMAX)
    if g_enc == 0:
        g_enc = F32(1)
    g_dec = f32_div(1, g_enc)
    mult = g_enc * F32(1.0 / 6.0)
    mp = math.ceil(m / tile_rows) * tile_rows
    xp = np.zeros((mp, k), dtype=F32)
    xp[:m] = x
    codes = np.zeros((mp, k), dtype=np.uint8)
    scales = np.zeros((mp, k // 16), dtype=np.uint8)
    for i in range(0, mp, tile_rows):
        for j in range(0, k, 16):
            blk = xp[i:i + tile_rows, j:j + 16]
            s_f = min(F32(np.abs(blk).max()) * mult, FMAX)
            s_code = int(fp8_round(np.array([np.clip(s_f, -448, 448)], dtype=F32))[0])
            s_val = F32(fp8_value(s_code))
            with np.errstate(divide="ignore", over="ignore"):
                enc = min(F32(1) / (s_val * g_dec), FMAX)
            codes[i:i + tile_rows, j:j + 16] = fp4_code(np.clip(blk * enc, -6, 6))
            scales[i:i + tile_rows, j // 16] = s_code
    return codes[:m], scales[:m]


def pack_rows_of(codes: np.ndarray) -> np.ndarray:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def oracle_nvfp4(x: np.ndarray, two_d: bool, amax=None):
    m, k = x.shape
    amax = F32(np.abs(x).max()) if amax is None else F32(amax)
    tile = 16 if two_d else 1
    rc, rs = oracle_nvfp4_dir(x, amax, tile)
    mp = math.ceil(m / 16) * 16
    xt = np.zeros((k, mp), dtype=F32)
    xt[:, :m] = x.T
    cc, cs = oracle_nvfp4_dir(xt, amax, tile)
    return {"rowwise_data": pack_rows_of(rc), "rowwise_scale_inv": rs,
            "columnwise_data": pack_rows_of(cc)[:, : m // 2], "columnwise_scale_inv": cs,
            "amax_rowwise": np.array([amax], dtype=F32), "amax_columnwise": np.array([amax], dtype=F32)}


ORACLES = {
    "fp8_tensor": lambda x: oracle_fp8_tensor(x, "e4m3", 448.0),
    "fp8_tensor_e5m2": lambda x: oracle_fp8_tensor(x, "e5m2", 57344.0),
    "fp8_block": oracle_fp8_block,
    "fp8_block_1x128": oracle_fp8_block_1x128,
    "mxfp8": oracle_mxfp8,
    "nvfp4_1d": lambda x: oracle_nvfp4(x, False),
    "nvfp4_2d": lambda x: oracle_nvfp4(x, True),
}

SHAPES = {
    "fp8_tensor": [(37, 53), (2, 3, 16)],
    "fp8_tensor_e5m2": [(37, 53)],
    "fp8_block": [(200, 300), (128, 256), (2, 70, 130)],
    "fp8_block_1x128": [(130, 260), (64, 128)],
    "mxfp8": [(64, 96), (2, 32, 64)],
    "nvfp4_1d": [(40, 48), (34, 64), (2, 16, 32)],
    "nvfp4_2d": [(40, 48), (34, 64), (2, 16, 32)],
}


def make_input(shape, dtype, seed):
    """Random values with magnitudes varying by 2^[-30, 30] along both dims (so blocks get different
    scales), one all-zero stripe, subnormal-scale entries and exact E2M1/FP8 grid points."""
    g = torch.Generator().manual_seed(seed)
    m, k = math.prod(shape[:-1]), shape[-1]
    mag = torch.exp2(torch.randint(-30, 31, (m, 1), generator=g).float()
                     + torch.randint(-4, 5, (1, k), generator=g).float())
    x = torch.randn(m, k, generator=g) * mag
    x[:, : min(k, 16)] = 0.0  # an all-zero column stripe
    if m > 20:
        x[3, :] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(k // 8 + 1)[:k]
        x[5, 1:] = 1e-39 * (torch.rand(k - 1, generator=g) + 0.5)  # float32 subnormals
    return x.to(dtype).reshape(shape)


def compare(name, q, expected):
    for key, exp in expected.items():
        got = q.buffers[key][q.valid[key]].cpu()
        exp_t = torch.from_numpy(np.ascontiguousarray(exp))
        assert tuple(got.shape) == tuple(exp_t.shape), (name, key, tuple(got.shape), tuple(exp_t.shape))
        if got.dtype == torch.float32:
            got, exp_t = got.view(torch.int32), exp_t.view(torch.int32)
        bad = (got != exp_t).nonzero()
        assert bad.numel() == 0, f"{name} {key}: {bad.shape[0]} differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_oracle(name, dtype):
    fmt = FORMATS[name]
    for i, shape in enumerate(SHAPES[name]):
        x = make_input(shape, dtype, seed=100 + i)
        q = fmt.quantize(x)
        x32 = x.float().reshape(-1, shape[-1]).numpy()
        compare(name, q, ORACLES[name](x32))


@pytest.mark.parametrize("name", list(FORMATS))
def test_matches_oracle_at_float32_extremes(name):
    # tiny: amax ~ 4e-37 (448/amax and 2688/amax overflow -> float32-max / 2^127 clamps), with
    # subnormals; huge: amax ~ 3e38 (near the float32 max)
    fmt = FORMATS[name]
    shape = SHAPES[name][0]
    g = torch.Generator().manual_seed(21)
    base = torch.randn(shape, generator=g)
    for x in (base * 1e-37, base.clamp(-5, 5) * 6e37, (base * 1e-37).bfloat16()):
        q = fmt.quantize(x)
        compare(name, q, ORACLES[name](x.float().reshape(-1, shape[-1]).numpy()))


@pytest.mark.parametrize("name", ["nvfp4_1d", "nvfp4_2d"])
def test_nvfp4_given_amax_matches_oracle(name):
    x = make_input((48, 64), torch.float32, seed=7)
    amax = float(x.abs().max()) * 3.5
    q = FORMATS[name].quantize(x, amax=torch.tensor(amax))
    compare(name, q, oracle_nvfp4(x.numpy(), name == "nvfp4_2d", amax=amax))


def test_torch_fp8_casts_match_oracle_rounding():
    # all float32 in a dense sweep around every E4M3/E5M2 value, incl. subnormals and ties
    for kind, dtype, top in (("e4m3", torch.float8_e4m3fn, 448.0), ("e5m2", torch.float8_e5m2, 57344.0)):
        table = torch.tensor(TABLES[kind], dtype=torch.float32)
        mids = (table[1:] + table[:-1]) / 2
        pts = torch.cat([table, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                         torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.rand(5000) * top])
        pts = torch.cat([pts, -pts])
        got = pts.clamp(-top, top).to(dtype).view(torch.uint8).numpy()
        assert (got == fp8_round(pts.numpy(), kind)).all(), kind
