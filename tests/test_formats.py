"""qgather.formats: public API, hand-checked vectors, padding, packing and error messages.

Expected bit patterns below are derived by hand (comments show the arithmetic) from
docs/formats.md and TE 2.20.2's kernels/reference quantizers, not from the code under test.
E4M3 bits: s eeee mmm, bias 7, value 2^(e-7) * (1 + m/8); subnormal (e=0): m * 2^-9.
"""

from __future__ import annotations

import pytest
import torch

from qgather.formats import FORMATS, Format, FormatError, QuantizedTensor

ALL = list(FORMATS)
F32 = torch.float32
BF16 = torch.bfloat16


def t32(rows):
    return torch.tensor(rows, dtype=F32)


def f32_scalar(v: float) -> float:
    """v rounded to float32 (as a Python float)."""
    return torch.tensor(v, dtype=F32).item()


def next_f32(a: float, toward: float) -> float:
    """The float32 neighbour of a in the direction of `toward`."""
    return torch.nextafter(torch.tensor(a, dtype=F32), torch.tensor(toward, dtype=F32)).item()


# ----------------------------------------------------------------------------- registry / API


def test_registry_names_and_row_blocks():
    assert list(FORMATS) == ["fp8_tensor", "fp8_tensor_e5m2", "fp8_block", "fp8_block_1x128", "mxfp8",
                             "nvfp4_1d", "nvfp4_2d"]
    expected = {"fp8_tensor": 1, "fp8_tensor_e5m2": 1, "fp8_block": 128, "fp8_block_1x128": 128,
                "mxfp8": 32, "nvfp4_1d": 16, "nvfp4_2d": 16}
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, Format)
        assert fmt.name == name
        assert fmt.row_block == expected[name]
    assert issubclass(FormatError, ValueError)


EXPECTED_SPECS = {
    # (M, K) = (200, 320): ceil(200/128)=2, ceil(320/128)=3, 320/32=10, 320/16=20, ceil(200/16)=13
    "fp8_tensor": {"data": ((200, 320), torch.uint8), "scale_inv": ((1,), F32)},
    "fp8_block": {"rowwise_data": ((200, 320), torch.uint8), "rowwise_scale_inv": ((2, 4), F32),
                  "columnwise_data": ((320, 200), torch.uint8), "columnwise_scale_inv": ((3, 4), F32)},
    "fp8_block_1x128": {"rowwise_data": ((200, 320), torch.uint8), "rowwise_scale_inv": ((3, 200), F32),
                        "columnwise_data": ((320, 200), torch.uint8),
                        "columnwise_scale_inv": ((2, 320), F32)},
    "nvfp4_1d": {"rowwise_data": ((200, 160), torch.uint8), "rowwise_scale_inv": ((256, 20), torch.uint8),
                 "columnwise_data": ((320, 100), torch.uint8),
                 "columnwise_scale_inv": ((384, 16), torch.uint8),
                 "amax_rowwise": ((1,), F32), "amax_columnwise": ((1,), F32)},
}


@pytest.mark.parametrize("name", list(EXPECTED_SPECS))
def test_buffer_shapes_dtypes_and_valid_regions(name):
    fmt = FORMATS[name]
    x = torch.randn(200, 320, dtype=BF16)
    q = fmt.quantize(x)
    assert isinstance(q, QuantizedTensor)
    assert q.format == name and q.shape == (200, 320)
    got = {k: (tuple(v.shape), v.dtype) for k, v in q.buffers.items()}
    assert got == EXPECTED_SPECS[name]
    assert set(q.valid) == set(q.buffers)
    for k, region in q.valid.items():
        buf = q.buffers[k]
        pad = torch.ones_like(buf, dtype=torch.bool)
        pad[region] = False
        assert not buf[pad].any(), f"{k}: padding must be zero"


def test_mxfp8_shapes():
    q = FORMATS["mxfp8"].quantize(torch.randn(96, 160))
    got = {k: tuple(v.shape) for k, v in q.buffers.items()}
    # rowwise scales (round_up(96,128), round_up(160/32=5, 4));
    # columnwise (round_up(96/32=3, 4), round_up(160, 128))
    assert got == {"rowwise_data": (96, 160), "rowwise_scale_inv": (128, 8), "columnwise_data": (96, 160),
                   "columnwise_scale_inv": (4, 256)}
    assert q.valid["rowwise_scale_inv"] == (slice(0, 96), slice(0, 5))
    assert q.valid["columnwise_scale_inv"] == (slice(0, 3), slice(0, 160))


def test_three_d_is_two_d():
    x = torch.randn(4, 32, 64, dtype=BF16)
    for name, fmt in FORMATS.items():
        q3 = fmt.quantize(x)
        q2 = fmt.quantize(x.reshape(128, 64))
        assert q3.shape == (4, 32, 64)
        assert q3.mismatches(q2) == [f"shape {(4, 32, 64)} != {(128, 64)}"], name
        assert fmt.dequantize(q3).shape == (4, 32, 64)
        assert torch.equal(fmt.dequantize(q3).reshape(128, 64), fmt.dequantize(q2))


def test_parameters_with_requires_grad():
    w = torch.nn.Parameter(torch.randn(64, 128))
    for name, fmt in FORMATS.items():
        q = fmt.quantize(w, amax=w.abs().max()) if fmt.per_tensor else fmt.quantize(w)
        assert q.bitwise_equal(fmt.quantize(w.detach())), name
        assert not any(t.requires_grad for t in q.buffers.values()), name


def test_non_contiguous_input_and_fp32_bf16_agree():
    x = torch.randn(64, 128, dtype=BF16)
    for name, fmt in FORMATS.items():
        a = fmt.quantize(x)
        b = fmt.quantize(x.float())  # bf16 -> fp32 is exact: same bits
        c = fmt.quantize(x.t().contiguous().t())  # a non-contiguous view of the same values
        assert a.bitwise_equal(b) and a.bitwise_equal(c), name


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dequantize_error_bound(name, dtype):
    # max error of a block format <= half an FP8/FP4 step of its block's largest value:
    # E4M3 2^-4 relative, E5M2 2^-3, E2M1 1/6 of the block's scaled max (step 2 at 6 -> 1/6),
    # plus the scale's own rounding for NVFP4 (E4M3 scale: 2^-4) -> 0.25 bound.
    fmt = FORMATS[name]
    torch.manual_seed(1)
    x = (torch.randn(96, 128) * torch.logspace(-3, 3, 128)).to(dtype)
    q = fmt.quantize(x)
    bound = {"fp8_tensor_e5m2": 0.125, "nvfp4_1d": 0.25, "nvfp4_2d": 0.25}.get(name, 0.0625)
    xf = x.float()
    outs = [fmt.dequantize(q)] + ([fmt.dequantize_columnwise(q)] if fmt.has_columnwise else [])
    for out in outs:
        assert out.dtype == F32 and out.shape == x.shape
        # per-element bound relative to the element's block max is format-specific; a global one:
        err = (out - xf).abs()
        assert float(err.max()) <= bound * float(xf.abs().max())
        if name.startswith("fp8_tensor"):
            # per-tensor scaling: relative error on normal-range values
            big = xf.abs() > float(xf.abs().max()) / 2 ** 6
            assert bool((err[big] <= bound * xf.abs()[big]).all())


# ----------------------------------------------------------------------------- fp8_tensor


def test_fp8_tensor_hand_vector():
    # amax 4 -> scale = 448/4 = 112, scale_inv = fl32(1/112)
    # 0.5*112 = 56 = 1.75*2^5 -> e=12, m=6 -> 0x66; -112 = -1.75*2^6 -> 0xEE;
    # 224 = 1.75*2^7 -> 0x76; 448 = 1.75*2^8 -> 0x7E; 0 -> 0x00; 1*112 = 1.75*2^6 -> 0x6E
    q = FORMATS["fp8_tensor"].quantize(t32([[0.5, -1.0, 2.0, 4.0], [0.0, 1.0, -0.0, -4.0]]))
    assert q.buffers["data"].tolist() == [[0x66, 0xEE, 0x76, 0x7E], [0x00, 0x6E, 0x80, 0xFE]]
    assert q.buffers["scale_inv"].tolist() == [f32_scalar(1 / 112)]


def test_fp8_tensor_e5m2_hand_vector():
    # E5M2: bias 15, 2 mantissa bits. amax 2 -> scale 57344/2 = 28672;
    # 2*28672 = 57344 = 1.75*2^15 -> e=30, m=3 -> 0x7B; 1*28672 = 1.75*2^14 -> 0x77;
    # 0.3*28672 = 8601.6 = 1.05*2^13 -> m = 0.2 -> 0 -> 2^13 -> e=28 -> 0x70
    q = FORMATS["fp8_tensor_e5m2"].quantize(t32([[2.0, 1.0], [0.3, -2.0]]))
    assert q.buffers["data"].tolist() == [[0x7B, 0x77], [0x70, 0xFB]]
    assert q.buffers["scale_inv"].tolist() == [f32_scalar(1 / 28672)]


def test_fp8_tensor_zero_and_extreme_amax():
    fmt = FORMATS["fp8_tensor"]
    # all zero: amax 0 -> scale 1 -> scale_inv 1, data 0
    q = fmt.quantize(torch.zeros(3, 5, dtype=BF16))
    assert q.buffers["scale_inv"].tolist() == [1.0] and not q.buffers["data"].any()
    # tiny amax: 448 / fl32(1e-38) overflows -> scale = f32 max; scale_inv = 1/f32max (subnormal)
    # 1e-38 * 3.4028235e38 = 3.4028 = 1.70*2^1 -> m = 5.6 -> 6 -> 3.5 -> e=8 -> 0x46
    q = fmt.quantize(t32([[1e-38, -1e-38], [0.0, 0.0]]))
    fmax = torch.finfo(F32).max
    assert q.buffers["scale_inv"].tolist() == [f32_scalar(1 / fmax)]
    assert q.buffers["data"].tolist() == [[0x46, 0xC6], [0, 0]]
    # huge amax 3e38: scale = 448/3e38 (normal); 3e38*scale -> 448 -> 0x7E; -1.5e38 -> -224 -> 0xF6
    q = fmt.quantize(t32([[3e38, -1.5e38]]))
    assert q.buffers["data"].tolist() == [[0x7E, 0xF6]]
    scale = f32_scalar(448 / f32_scalar(3e38))
    assert q.buffers["scale_inv"].tolist() == [f32_scalar(1 / scale)]


def test_fp8_tensor_given_amax_saturates():
    # amax=1 given while |x| reaches 4: scale 448, 4*448 saturates to 448 (0x7E), not NaN
    q = FORMATS["fp8_tensor"].quantize(t32([[4.0, -4.0, 0.5]]), amax=torch.tensor(1.0))
    assert q.buffers["data"].tolist() == [[0x7E, 0xFE, 0x76]]  # 0.5*448 = 224 -> 0x76
    q = FORMATS["fp8_tensor_e5m2"].quantize(t32([[4.0, 1.0]]), amax=1.0)
    assert q.buffers["data"].tolist() == [[0x7B, 0x7B]]  # E5M2 max 57344 = 0x7B, saturated


# ----------------------------------------------------------------------------- fp8_block


def test_fp8_block_pow2_scales_and_edge_tiles():
    fmt = FORMATS["fp8_block"]
    x = torch.zeros(200, 300)
    # tile (0,0): amax 3 -> 448/3 = 149.3 -> pow2 floor 128; 3*128 = 384 = 1.5*2^8 -> 0x7C; 1*128 -> 0x70
    x[0, 0], x[5, 7] = 3.0, -1.0
    # tile (0,1): amax 448 -> scale 1; 448 -> 0x7E
    x[100, 200] = 448.0
    # tile (1,2): partial (rows 128..199, cols 256..299), amax 0.3 -> 448/0.3 = 1493.3 -> 1024
    # 0.3*1024 = 307.2 = 1.2*2^8 -> m = 1.6 -> 2 -> 320 -> 0x7A
    x[199, 299] = 0.3
    # tile (1,0): amax 1e-38 -> 448/1e-38 = inf -> 2^127; 1e-38*2^127 = 1.70 -> 1.75 -> 0x3E
    x[150, 3] = 1e-38
    # tile (0,2) and (1,1): all zero -> scale 1
    q = fmt.quantize(x)
    d = q.buffers["rowwise_data"]
    assert (d[0, 0].item(), d[5, 7].item(), d[100, 200].item(), d[199, 299].item(), d[150, 3].item()) == (
        0x7C, 0xF0, 0x7E, 0x7A, 0x3E)
    assert int((d != 0).sum()) == 5
    sinv = q.buffers["rowwise_scale_inv"]
    assert sinv.shape == (2, 4)
    assert sinv.tolist() == [[1 / 128, 1.0, 1.0, 0.0], [2.0 ** -127, 1.0, 1 / 1024, 0.0]]
    assert q.buffers["columnwise_scale_inv"].tolist() == [[1 / 128, 2.0 ** -127, 0.0, 0.0],
                                                          [1.0, 1.0, 0.0, 0.0],
                                                          [1.0, 1 / 1024, 0.0, 0.0]]
    assert torch.equal(q.buffers["columnwise_data"], d.t())


def test_fp8_block_1x128_layout():
    fmt = FORMATS["fp8_block_1x128"]
    x = torch.zeros(130, 260)
    x[0, 0] = 3.0  # row 0, K-block 0: scale 128 (as above); column 0, M-block 0: scale 128
    x[129, 259] = 0.3  # row 129, K-block 2: 1024; column 259, M-block 1: 1024 -> 0x7A
    x[1, 200] = 448.0  # row 1, K-block 1: 1; column 200, M-block 0: 1 -> 0x7E
    q = fmt.quantize(x)
    rs = q.buffers["rowwise_scale_inv"]  # (ceil(260/128)=3, round_up(130, 4)=132), M along dim 1
    assert rs.shape == (3, 132)
    assert rs[0, 0].item() == 1 / 128 and rs[2, 129].item() == 1 / 1024 and rs[1, 1].item() == 1.0
    assert rs[:, 130:].abs().sum() == 0 and int((rs[:, :130] != 1.0).sum()) == 2
    cs = q.buffers["columnwise_scale_inv"]  # (ceil(130/128)=2, round_up(260, 4)=260)
    assert cs.shape == (2, 260)
    assert cs[0, 0].item() == 1 / 128 and cs[1, 259].item() == 1 / 1024 and cs[0, 200].item() == 1.0
    assert int((cs != 1.0).sum()) == 2
    cd = q.buffers["columnwise_data"]  # (K, M)
    assert cd.shape == (260, 130)
    assert (cd[0, 0].item(), cd[259, 129].item(), cd[200, 1].item()) == (0x7C, 0x7A, 0x7E)
    assert torch.equal(cd.t(), q.buffers["rowwise_data"])  # same scales on these entries


# ----------------------------------------------------------------------------- mxfp8


def test_mxfp8_e8m0_codes():
    fmt = FORMATS["mxfp8"]
    x = torch.zeros(32, 128)
    # block (0, 0): amax 448: 448*fl32(1/448) rounds to exactly 1.0 -> code 127, x*1 -> 448 -> 0x7E
    x[0, 0] = 448.0
    # block (1, 0): amax 449: 449/448 > 1 -> rounds up to 2 -> code 128; 449/2 = 224.5 -> 224 -> 0x76
    x[1, 5] = 449.0
    # block (2, 1): amax 1: fl32(1/448) = 1.14*2^-9 -> 2^-8 -> code 119; 1*2^8 = 256 -> 0x78
    x[2, 40] = -1.0
    # block (3, 2): amax 2^-140 (f32 subnormal): product <= 2^-127 -> code 0 -> multiplier 1 -> 0
    x[3, 70] = 2.0 ** -140
    q = fmt.quantize(x)
    codes = q.buffers["rowwise_scale_inv"]
    assert codes.shape == (128, 4)
    assert (codes[0, 0].item(), codes[1, 0].item(), codes[2, 1].item(), codes[3, 2].item()) == (
        127, 128, 119, 0)
    assert not codes[32:].any() and int((codes != 0).sum()) == 3  # padding rows zero, other blocks 0
    d = q.buffers["rowwise_data"]
    assert (d[0, 0].item(), d[1, 5].item(), d[2, 40].item(), d[3, 70].item()) == (0x7E, 0x76, 0xF8, 0)
    # columnwise: column 0 block has amax 448 -> 127; column 5 -> 449 -> 128; column 40 -> 119
    cc = q.buffers["columnwise_scale_inv"]
    assert (cc[0, 0].item(), cc[0, 5].item(), cc[0, 40].item(), cc[0, 70].item(), cc[0, 1].item()) == (
        127, 128, 119, 0, 0)
    assert fmt.dequantize(q)[1, 5].item() == 448.0  # 224 * 2^(128-127)


# ----------------------------------------------------------------------------- nvfp4

# E2M1 codes of v (g_enc = 1, block scale 1.0, so v = x): ties go to the even code.
TIE_ROW = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0]
TIE_CODES = [0, 0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14]
# float32 neighbours of the boundaries, on the side that flips the code
NEIGHBOURS = [(0.25, 1.0, 1), (0.75, 0.0, 1), (1.25, 2.0, 3), (1.75, 0.0, 3), (2.5, 3.0, 5), (3.5, 0.0, 5),
              (5.0, 6.0, 7)]
GRID_ROW = [0.5, 6.0, 1.0, 1.5, 2.0, 3.0, 4.0, 0.1, -0.1, -0.5, -6.0, -4.0, 0.0, -0.0, 5.9, -5.9]
GRID_CODES = [1, 7, 2, 3, 4, 5, 6, 0, 8, 9, 15, 14, 0, 0, 7, 15]


def pack(codes):
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]


@pytest.mark.parametrize("name", ["nvfp4_1d", "nvfp4_2d"])
def test_nvfp4_e2m1_bins_ties_and_packing(name):
    # amax = 2688 = 6*448 -> g_enc = 1, g_dec = 1. Row blocks have amax 6:
    # s = e4m3(6 * fl32(1/6)) = e4m3(1.00000003 -> 1.0) = 1.0 (bits 0x38); enc = 1/(1*1) = 1 -> v = x.
    fmt = FORMATS[name]
    nb_lo = [next_f32(a, b) for a, b, _ in NEIGHBOURS]
    nb_codes = [c for _, _, c in NEIGHBOURS]
    row3 = nb_lo + [-v for v in nb_lo] + [6.0, 0.0]
    codes3 = nb_codes + [c + 8 for c in nb_codes] + [7, 0]
    rows = [TIE_ROW, GRID_ROW, row3, [6.0] + [0.0] * 15]
    x = t32(rows)
    q = fmt.quantize(x, amax=torch.tensor(2688.0))
    expect = [pack(TIE_CODES), pack(GRID_CODES), pack(codes3), pack([7] + [0] * 15)]
    if name == "nvfp4_1d":
        assert q.buffers["rowwise_data"].tolist() == expect
    else:
        # one 16x16 tile (rows 4..15 zero-padded): tile amax 6 -> the same scale, same codes
        assert q.buffers["rowwise_data"].tolist() == expect
    assert q.buffers["rowwise_data"][1, 0].item() == 0x71  # element 0 (0.5 -> 1) low, element 1 (6 -> 7) high
    assert q.buffers["rowwise_scale_inv"][:4, 0].tolist() == [0x38] * 4
    assert q.buffers["amax_rowwise"].tolist() == [2688.0] == q.buffers["amax_columnwise"].tolist()
    # dequantize: code value * s * amax / 2688 = the E2M1 value itself
    values = [0, 0, 1, 1, 2, 2, 4, 4, 6, -0.0, -1, -1, -2, -2, -4, -4]
    assert fmt.dequantize(q)[0].tolist() == values


def test_nvfp4_scale_from_data_and_subnormal_scales():
    fmt = FORMATS["nvfp4_1d"]
    # global amax 2688 from the data (row 1) -> g_enc = 1.
    # row 0 block 0: amax fl32(0.01): s = e4m3(0.0016667) (subnormal, 2^-9 steps: 0.853 -> 1) -> 0x01,
    #   enc = 1/2^-9 = 512: 0.01*512 = 5.12 -> 7; -0.005*512 = -2.56 -> 13; 0.002*512 = 1.024 -> 2
    # row 0 block 1: amax 0.02: s = e4m3(0.003333) -> 1.7067 -> 2 -> 0x02, enc 256:
    #   0.02*256 = 5.12 -> 7; 0.007*256 = 1.792 -> 4
    # row 1 block 0: amax 2688 -> s = e4m3(448.00001) -> clamp 448 -> 0x7E, enc = fl32(1/448):
    #   2688*fl(1/448) = 6.0000001 -> 7; 1000*fl(1/448) = 2.232 -> 4
    # row 1 block 1: all zero -> s = 0 -> enc = min(1/0, fmax) -> codes 0
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[0, 2] = 0.01, -0.005, 0.002
    x[0, 16], x[0, 17] = 0.02, 0.007
    x[1, 0], x[1, 1] = 2688.0, 1000.0
    q = fmt.quantize(x)
    assert q.buffers["amax_rowwise"].tolist() == [2688.0]
    assert q.buffers["rowwise_scale_inv"][:2, :2].tolist() == [[0x01, 0x02], [0x7E, 0x00]]
    d = q.buffers["rowwise_data"]
    assert d[0, :2].tolist() == [7 | (13 << 4), 2]
    assert d[0, 8:10].tolist() == [7 | (4 << 4), 0]
    assert d[1, :2].tolist() == [7 | (4 << 4), 0] and d[1, 8:].sum() == 0


def test_nvfp4_all_zero_and_extreme_amax():
    for name in ("nvfp4_1d", "nvfp4_2d"):
        fmt = FORMATS[name]
        # all zero: amax 0 -> g_enc = min(2688/0, fmax) = fmax; every s = 0; codes 0
        q = fmt.quantize(torch.zeros(32, 32, dtype=BF16))
        assert q.buffers["amax_rowwise"].tolist() == [0.0]
        for k in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            assert not q.buffers[k].any(), (name, k)
        assert not fmt.dequantize(q).any()
        # tiny amax 1e-38 (fp32 input): g_enc = min(2688/1e-38 = inf, fmax) = fmax,
        # s = e4m3(1e-38 * fmax/6 = 0.567) = 0.5625 (0x31); enc = min(1/(0.5625/fmax), fmax) = fmax;
        # 1e-38 * fmax = 3.40 -> code 5 (2.5 < 3.40 < 3.5)
        x = torch.zeros(16, 16)
        x[0, 0] = 1e-38
        q = fmt.quantize(x)
        assert q.buffers["rowwise_scale_inv"][0, 0].item() == 0x31, name
        assert q.buffers["rowwise_data"][0, 0].item() == 5, name
        # huge amax 3e38: block amax = amax -> s = e4m3(~448) = 448; x * enc ~= 6 -> code 7 (6)
        x = torch.zeros(16, 16)
        x[0, 0], x[0, 1] = 3e38, -1.0e38
        q = fmt.quantize(x)
        assert q.buffers["rowwise_scale_inv"][0, 0].item() == 0x7E, name
        # -1e38 * enc = -2.0 -> code 12 (high nibble)
        assert q.buffers["rowwise_data"][0, 0].item() == 7 | (12 << 4), name
        out = fmt.dequantize(q)
        assert torch.isfinite(out).all()
        assert abs(out[0, 0].item() - 3e38) / 3e38 < 1e-5


def test_nvfp4_2d_scale_on_every_tile_row_and_padding():
    fmt = FORMATS["nvfp4_2d"]
    torch.manual_seed(0)
    x = torch.randn(40, 48, dtype=BF16)  # tiles: 3 along M (last one 8 rows), 3 along K
    q = fmt.quantize(x)
    s = q.buffers["rowwise_scale_inv"]
    assert s.shape == (128, 4)
    for r in range(40):
        assert torch.equal(s[r, :3], s[(r // 16) * 16, :3])
    assert not s[40:].any() and not s[:, 3:].any()
    cs = q.buffers["columnwise_scale_inv"]  # (round_up(48, 128), round_up(3, 4))
    assert cs.shape == (128, 4)
    assert torch.equal(cs[:48, :3], s[0:40:16, :3].t().repeat_interleave(16, dim=0))
    assert not cs[48:].any() and not cs[:, 3:].any()


def test_nvfp4_1d_scale_padding_shapes():
    q = FORMATS["nvfp4_1d"].quantize(torch.randn(34, 64))
    # rowwise (round_up(34,128), round_up(4,4)); columnwise (round_up(64,128), round_up(ceil(34/16)=3, 4))
    assert q.buffers["rowwise_scale_inv"].shape == (128, 4)
    assert q.buffers["columnwise_scale_inv"].shape == (128, 4)
    assert q.buffers["columnwise_data"].shape == (64, 17)
    assert q.valid["columnwise_scale_inv"] == (slice(0, 64), slice(0, 3))


def test_nvfp4_unpacked_nibble_order_via_dequantize():
    # x = [0.5, 1, 1.5, 2, ...]: if nibbles were swapped, dequantize would return [1, 0.5, 2, 1.5, ...]
    # row 1 is all 6.0, so every 16x1 column block has amax 6 too (scale 1.0, v = x as above)
    fmt = FORMATS["nvfp4_1d"]
    row = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0] * 2
    q = fmt.quantize(t32([row, [6.0] * 16]), amax=2688.0)
    assert fmt.dequantize(q)[0].tolist() == row
    assert q.buffers["rowwise_data"][0, :4].tolist() == [1 | 2 << 4, 3 | 4 << 4, 5 | 6 << 4, 7 | 0 << 4]
    # columnwise packs along M: x[0, k] in the low nibble of byte (k, 0), x[1, k] (code 7) in the high
    assert q.buffers["columnwise_data"][:, 0].tolist() == [c | 7 << 4 for c in [1, 2, 3, 4, 5, 6, 7, 0] * 2]
    assert fmt.dequantize_columnwise(q)[0].tolist() == row


# ----------------------------------------------------------------------------- constant blocks


@pytest.mark.parametrize("name", ALL)
def test_constant_tensor(name):
    # a constant c: every block's amax is |c|; each value maps to the block max code
    fmt = FORMATS[name]
    x = torch.full((64, 64), -1.5)
    q = fmt.quantize(x)
    out = fmt.dequantize(q)
    # -1.5 is exact in every format here: fp8 (1.5 * 2^k exact), nvfp4 (max code 6 * scale)
    assert torch.equal(out, x), name


# ----------------------------------------------------------------------------- errors


def one_line_error(fn, name, needle):
    with pytest.raises(FormatError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{name}:") and needle in msg, msg
    return msg


BAD_SHAPES = {
    "mxfp8": [((32, 40), "K=40 must be a multiple of 32"), ((48, 64), "M=48"), ((2, 40, 64), "M=80")],
    "nvfp4_1d": [((16, 40), "K=40 must be a multiple of 16"), ((15, 32), "M=15")],
    "nvfp4_2d": [((16, 40), "K=40 must be a multiple of 16"), ((3, 5, 32), "M=15")],
}


@pytest.mark.parametrize("name", ALL)
def test_bad_inputs_raise_one_line(name):
    fmt = FORMATS[name]
    one_line_error(lambda: fmt.quantize(torch.ones(64)), name, "at least 2 dims")
    one_line_error(lambda: fmt.quantize(torch.tensor(1.0)), name, "at least 2 dims")
    one_line_error(lambda: fmt.quantize(torch.ones(64, 64, dtype=torch.int32)), name, "dtype")
    one_line_error(lambda: fmt.quantize(torch.ones(64, 64, dtype=torch.bool)), name, "dtype")
    one_line_error(lambda: fmt.quantize(torch.ones(64, 64, dtype=torch.float64)), name, "dtype")
    one_line_error(lambda: fmt.quantize([[1.0]]), name, "torch.Tensor")
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.ones(64, 64, dtype=BF16)
        x[7, 9] = bad
        one_line_error(lambda x=x: fmt.quantize(x), name, "NaN or inf")
    if name != "fp8_tensor" and name != "fp8_tensor_e5m2":
        one_line_error(lambda: fmt.quantize(torch.ones(64, 0)), name, "K=0")
    for shape, needle in BAD_SHAPES.get(name, []):
        one_line_error(lambda shape=shape: fmt.quantize(torch.ones(shape)), name, needle)
        one_line_error(lambda shape=shape: fmt.check(shape, F32), name, needle)
    if fmt.per_tensor:
        one_line_error(lambda: fmt.quantize(torch.ones(64, 64), amax=torch.tensor(float("nan"))), name,
                       "amax")
        one_line_error(lambda: fmt.quantize(torch.ones(64, 64), amax=torch.tensor(-1.0)), name, "amax")
        one_line_error(lambda: fmt.quantize(torch.ones(64, 64), amax=torch.ones(2)), name, "amax")
    else:
        with pytest.raises(ValueError, match="amax"):
            fmt.quantize(torch.ones(128, 128), amax=torch.tensor(1.0))
    if not fmt.has_columnwise:
        one_line_error(lambda: fmt.dequantize_columnwise(fmt.quantize(torch.ones(4, 4))), name, "columnwise")
    other = FORMATS["fp8_tensor" if name != "fp8_tensor" else "fp8_block"]
    q_other = other.quantize(torch.ones(128, 128))
    one_line_error(lambda: fmt.dequantize(q_other), name, "format")
    fmt.check((128, 128), BF16)  # a good shape passes


def test_empty_rows_are_allowed():
    # FSDP2 ranks can hold zero rows: M = 0 quantizes to empty buffers
    for name, fmt in FORMATS.items():
        q = fmt.quantize(torch.zeros(0, 128))
        assert q.shape == (0, 128)
        assert fmt.dequantize(q).shape == (0, 128), name
        rows, glob = fmt.to_rows(q)
        assert all(t.shape[0] == 0 for t in rows.values()), name
        assert fmt.from_rows(rows, glob, (0, 128)).bitwise_equal(q), name
    q = FORMATS["fp8_tensor"].quantize(torch.zeros(4, 0))  # a per-tensor format holds K=0 too
    assert q.buffers["data"].shape == (4, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ALL)
def test_cuda_matches_cpu(name):
    torch.manual_seed(3)
    x = torch.randn(256, 384, dtype=BF16)
    fmt = FORMATS[name]
    qc = fmt.quantize(x)
    qg = fmt.quantize(x.cuda())
    assert qg.device.type == "cuda"
    assert qc.mismatches(qg.to("cpu")) == []


def test_packed_e2m1_pairs_read_as_the_unpacked_codes_values():
    from qgather.formats import numerics as nx

    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    expected = nx.e2m1_values(nx.unpack_nibbles(every_byte))
    assert torch.equal(nx.e2m1_pair_values(every_byte).view(torch.int32), expected.view(torch.int32))  # -0.0 too


def test_the_e2m1_pair_table_holds_every_bytes_two_values():
    from qgather.formats import numerics as nx

    table = nx.e2m1_pair_table(torch.empty(0, dtype=torch.uint8))
    want = torch.tensor([(nx.E2M1_VALUES[b & 15], nx.E2M1_VALUES[b >> 4]) for b in range(256)])
    assert torch.equal(table.view(torch.int32), want.view(torch.int32))  # -0.0 for code 8
