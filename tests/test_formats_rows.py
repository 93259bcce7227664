"""qgather.formats row layout (to_rows / from_rows): round trips, shard locality, simulated
FSDP2 gathers, misaligned shards, strict shape checks, and the columnwise derivations."""

from __future__ import annotations

import math

import pytest
import torch

from qgather.formats import FORMATS, FormatError

ALL = list(FORMATS)

# shapes each format can hold, with partial edge blocks where the format allows them
SHAPES = {
    "fp8_tensor": [(200, 300), (3, 40, 24), (1, 8)],
    "fp8_tensor_e5m2": [(200, 300), (3, 40, 24)],
    "fp8_block": [(200, 300), (256, 128), (3, 100, 130)],
    "fp8_block_1x128": [(200, 300), (256, 128), (3, 100, 130)],
    "mxfp8": [(96, 160), (2, 64, 32)],
    "nvfp4_1d": [(200, 96), (34, 64), (3, 16, 48)],
    "nvfp4_2d": [(200, 96), (34, 64), (3, 16, 48)],
}


def rand(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = math.prod(shape[:-1])
    scale = torch.exp2(torch.randint(-8, 9, (m, 1), generator=g).float())
    return (torch.randn(m, shape[-1], generator=g) * scale).to(dtype).reshape(shape)


def shard_quantize(fmt, x2, a, b, amax):
    xs = x2[a:b]
    return fmt.quantize(xs, amax=amax) if fmt.per_tensor else fmt.quantize(xs)


def entry_slice(a, b, r):
    return slice(a // r, -(-b // r))


@pytest.mark.parametrize("name", ALL)
def test_round_trip_is_bitwise(name):
    fmt = FORMATS[name]
    for i, shape in enumerate(SHAPES[name]):
        for dtype in (torch.float32, torch.bfloat16):
            q = fmt.quantize(rand(shape, dtype, seed=i))
            rows, glob = fmt.to_rows(q)
            assert set(rows) == set(fmt.rows_per_entry) and set(glob) == set(fmt.glob_keys)
            m = math.prod(shape[:-1])
            for key, t in rows.items():
                r = fmt.rows_per_entry[key]
                assert t.is_contiguous() and t.shape[0] == -(-m // r), (name, key, t.shape)
                spec = fmt.row_specs(shape)[key]
                assert (tuple(t.shape), t.dtype) == spec
            q2 = fmt.from_rows(rows, glob, shape)
            assert q.mismatches(q2) == [], (name, shape)  # padding included


@pytest.mark.parametrize("name", ALL)
def test_aligned_shards_are_slices_of_the_full_quantization(name):
    fmt = FORMATS[name]
    shape = (320, 96) if name != "mxfp8" else (320, 64)
    x = rand(shape, seed=5)
    full = fmt.quantize(x)
    rows, glob = fmt.to_rows(full)
    amax = x.float().abs().max()
    rb = fmt.row_block
    m = shape[0]
    last = (m - 1) // rb * rb  # start of the last (partial) block
    splits = [(0, rb), (0, 2 * rb), (rb, m), (last, m), (rb, 2 * rb), (rb, rb)]  # (rb, rb): empty shard
    for a, b in splits:
        assert a % rb == 0 and (b % rb == 0 or b == m) and a <= b <= m
        q = shard_quantize(fmt, x, a, b, amax)
        srows, sglob = fmt.to_rows(q)
        for key, t in rows.items():
            expect = t[entry_slice(a, b, fmt.rows_per_entry[key])]
            assert torch.equal(srows[key], expect), (name, key, a, b)
        for key, t in glob.items():
            assert torch.equal(sglob[key], t), (name, key)


@pytest.mark.parametrize("name", ALL)
def test_misaligned_shard_differs_for_block_formats(name):
    fmt = FORMATS[name]
    if fmt.row_block == 1:
        pytest.skip("per-tensor format: every row split is aligned")
    x = rand((320, 64), seed=9)
    rows, _ = fmt.to_rows(fmt.quantize(x))
    a = fmt.row_block // 2  # 64, 16, 8
    b = a + 4 * fmt.row_block
    q = shard_quantize(fmt, x, a, b, x.float().abs().max())
    srows, _ = fmt.to_rows(q)
    differs = []
    for key, t in rows.items():
        expect = t[entry_slice(a, b, fmt.rows_per_entry[key])]
        if srows[key].shape != expect.shape or not torch.equal(srows[key], expect):
            differs.append(key)
    assert differs, name  # the harness can see the scrambled scales


def simulate_gather(fmt, x, bounds, amax):
    """Each shard quantized alone (global amax for per-tensor formats), row entries concatenated in
    rank order, then from_rows: the FSDP2 all-gather of the row layout."""
    parts = [fmt.to_rows(shard_quantize(fmt, x, a, b, amax)) for a, b in bounds]
    rows = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
    glob = parts[0][1]
    return fmt.from_rows(rows, glob, tuple(x.shape))


@pytest.mark.parametrize("name", ALL)
def test_gather_of_aligned_shards_is_bit_exact(name):
    fmt = FORMATS[name]
    rb = max(fmt.row_block, 16 if name.startswith("nvfp4") else 1)
    k = 64
    m = rb * 6 + (rb // 2 if name not in ("mxfp8",) else 0)  # partial last block where allowed
    x = rand((m, k), seed=11)
    amax = x.float().abs().max()
    full = fmt.quantize(x)
    # world sizes 2, 3 and 4 with shard rows rounded up to the row block; trailing shards may be short
    # or empty (FSDP2 uneven sharding)
    for world in (2, 3, 4):
        per = -(-m // world)
        per = -(-per // rb) * rb
        bounds = [(min(r * per, m), min((r + 1) * per, m)) for r in range(world)]
        got = simulate_gather(fmt, x, bounds, amax)
        assert full.mismatches(got) == [], (name, world, bounds)
    # 3-D expert weights sharded along the expert dim
    x3 = rand((4, rb * 2, k), seed=12)
    amax3 = x3.float().abs().max()
    full3 = fmt.quantize(x3)
    parts = [(0, 1), (1, 3), (3, 4)]
    pieces = [fmt.to_rows(fmt.quantize(x3[a:b], amax=amax3) if fmt.per_tensor else fmt.quantize(x3[a:b]))
              for a, b in parts]
    rows = {kk: torch.cat([p[0][kk] for p in pieces]) for kk in pieces[0][0]}
    assert full3.mismatches(fmt.from_rows(rows, pieces[0][1], x3.shape)) == []


def test_misaligned_gather_is_rejected_by_shape():
    # bug class 1: M = 136 on 8 ranks of 17 rows. NVFP4 cannot even hold a 17-row shard (its
    # columnwise data packs row pairs) ...
    fmt = FORMATS["nvfp4_1d"]
    x = rand((136, 32), seed=3)
    amax = x.float().abs().max()
    with pytest.raises(FormatError, match=r"^nvfp4_1d: M=17 .* multiple of 2$"):
        fmt.quantize(x[17:34], amax=amax)
    # ... and with 18-row shards (even, misaligned to 16) the 16-row scale blocks gather into
    # 7 * ceil(18/16) + ceil(10/16) = 15 entries for a tensor that has ceil(136/16) = 9
    bounds = [(0, 18), (18, 36), (36, 54), (54, 72), (72, 90), (90, 108), (108, 126), (126, 136)]
    with pytest.raises(FormatError) as info:
        simulate_gather(fmt, x, bounds, amax)
    assert str(info.value) == ("nvfp4_1d: rows['columnwise_scale_inv'] is torch.uint8(15, 32), "
                               "expected torch.uint8(9, 32)")


@pytest.mark.parametrize("name", ALL)
def test_from_rows_rejects_wrong_keys_dtypes_and_shapes(name):
    fmt = FORMATS[name]
    shape = SHAPES[name][0]
    rows, glob = fmt.to_rows(fmt.quantize(rand(shape)))
    key = next(iter(rows))
    bad = dict(rows)
    bad[key] = rows[key][1:]
    with pytest.raises(FormatError, match=rf"^{name}: rows\['{key}'\]"):
        fmt.from_rows(bad, glob, shape)
    bad = dict(rows)
    bad[key] = rows[key].to(torch.int16)
    with pytest.raises(FormatError, match="expected"):
        fmt.from_rows(bad, glob, shape)
    bad = dict(rows)
    del bad[key]
    with pytest.raises(FormatError, match="keys"):
        fmt.from_rows(bad, glob, shape)
    with pytest.raises(FormatError, match="glob keys"):
        fmt.from_rows(rows, {**glob, "extra": torch.zeros(1)}, shape)


def _arbitrary_rows(rows, seed):
    """Row buffers of the same keys, dtypes and shapes with arbitrary contents (uint8: any byte;
    float scales: any positive value): what a broken gather could hand over."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g) if v.dtype == torch.uint8
            else torch.rand(v.shape, generator=g).add_(0.5) for k, v in rows.items()}


@pytest.mark.parametrize("name", ALL)
def test_dequantize_row_layout_is_dequantize_of_from_rows(name):
    """Read from the row layout directly, the values are those of the rebuilt TE layout, bit for bit,
    for quantized rows and for arbitrary bytes (nvfp4_2d reads each tile's first row, as from_rows)."""
    fmt = FORMATS[name]
    for i, shape in enumerate(SHAPES[name]):
        rows, glob = fmt.to_rows(fmt.quantize(rand(shape, seed=i)))
        for buffers in (rows, _arbitrary_rows(rows, i)):
            want = fmt.dequantize(fmt.from_rows(buffers, glob, shape))
            got = fmt.dequantize_row_layout(buffers, glob, shape)
            assert got.dtype == torch.float32 and got.shape == want.shape == shape
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, shape)


@pytest.mark.parametrize("name", ["fp8_tensor", "nvfp4_1d"])
def test_dequantize_row_layout_checks_like_from_rows(name):
    fmt = FORMATS[name]
    shape = SHAPES[name][0]
    rows, glob = fmt.to_rows(fmt.quantize(rand(shape)))
    key = next(iter(rows))
    with pytest.raises(FormatError, match=rf"^{name}: rows\['{key}'\]"):
        fmt.dequantize_row_layout({**rows, key: rows[key][1:]}, glob, shape)
    with pytest.raises(FormatError, match="glob keys"):
        fmt.dequantize_row_layout(rows, {**glob, "extra": torch.zeros(1)}, shape)


# ----------------------------------------------------------------------------- columnwise derivations


def test_nvfp4_2d_columnwise_is_transpose_of_tiles():
    # columnwise of x == rowwise of x^T (16x16 tiles transpose exactly, same global amax)
    fmt = FORMATS["nvfp4_2d"]
    for shape in [(64, 96), (48, 32)]:
        x = rand(shape, seed=4)
        q = fmt.quantize(x)
        qt = fmt.quantize(x.t().contiguous())
        assert torch.equal(q.buffers["columnwise_data"], qt.buffers["rowwise_data"])
        assert torch.equal(q.buffers["columnwise_scale_inv"][q.valid["columnwise_scale_inv"]],
                           qt.buffers["rowwise_scale_inv"][qt.valid["rowwise_scale_inv"]])
        # and from_rows (which derives columnwise from rowwise) gives the same buffers
        rows, glob = fmt.to_rows(q)
        assert fmt.from_rows(rows, glob, shape).mismatches(q) == []


def test_nvfp4_1d_columnwise_is_1d_quantization_of_transpose():
    fmt = FORMATS["nvfp4_1d"]
    x = rand((64, 96), seed=6)
    q = fmt.quantize(x)
    qt = fmt.quantize(x.t().contiguous(), amax=q.buffers["amax_rowwise"])
    assert torch.equal(q.buffers["columnwise_data"], qt.buffers["rowwise_data"])
    assert torch.equal(q.buffers["columnwise_scale_inv"][q.valid["columnwise_scale_inv"]],
                       qt.buffers["rowwise_scale_inv"][qt.valid["rowwise_scale_inv"]])
    # bug class 7: deriving 1D columnwise data by transposing the rowwise codes is NOT exact
    codes = torch.stack((q.buffers["rowwise_data"] & 15, q.buffers["rowwise_data"] >> 4), -1).reshape(64, 96)
    naive = (codes[0::2] | (codes[1::2] << 4)).t()
    assert not torch.equal(naive, q.buffers["columnwise_data"])


def test_fp8_block_columnwise_relations():
    x = rand((200, 300), seed=8)
    q2 = FORMATS["fp8_block"].quantize(x)
    q2t = FORMATS["fp8_block"].quantize(x.t().contiguous())
    assert torch.equal(q2.buffers["columnwise_data"], q2t.buffers["rowwise_data"])
    assert torch.equal(q2.buffers["columnwise_scale_inv"][:3, :2], q2t.buffers["rowwise_scale_inv"][:3, :2])
    q1 = FORMATS["fp8_block_1x128"].quantize(x)
    q1t = FORMATS["fp8_block_1x128"].quantize(x.t().contiguous())
    assert torch.equal(q1.buffers["columnwise_data"], q1t.buffers["rowwise_data"])
    # columnwise scales (Mb, K) of x == rowwise scales (Kb', M') of x^T: both (ceil(200/128), 300)
    assert torch.equal(q1.buffers["columnwise_scale_inv"][:2, :300],
                       q1t.buffers["rowwise_scale_inv"][:2, :300])


def test_mxfp8_columnwise_relation():
    x = rand((96, 64), seed=10)
    q = FORMATS["mxfp8"].quantize(x)
    qt = FORMATS["mxfp8"].quantize(x.t().contiguous())
    assert torch.equal(q.buffers["columnwise_data"], qt.buffers["rowwise_data"].t())
    assert torch.equal(q.buffers["columnwise_scale_inv"][:3, :64],
                       qt.buffers["rowwise_scale_inv"][:64, :3].t())
