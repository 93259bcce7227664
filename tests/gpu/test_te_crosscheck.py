"""Bit-for-bit cross-check of qgather.formats against TransformerEngine 2.20.2 on a CUDA GPU.

    python -m pytest tests/gpu/test_te_crosscheck.py -q -p no:cacheprovider -m gpu

For each format, random bf16 and fp32 inputs of a few shapes (partial edge blocks where the format
allows them) and an "extremes" input are quantized by TE and by FORMATS[...] on the GPU, and every
buffer is compared bit for bit in its valid region (amax too):
  fp8_tensor*      Float8CurrentScalingQuantizer (E4M3 / E5M2)
  fp8_block*       Float8BlockQuantizer(block_scaling_dim=2 / 1, force_pow_2_scales=True)
  mxfp8            MXFP8Quantizer (its kernels may not run on sm_90: then SKIP with TE's error)
  nvfp4_1d / _2d   custom_recipes.reference_nvfp4.NVFP4QuantizerRef, tile (1, 16) / (16, 16)
Extra checks: dequantize() against TE's dequantize, and (nvfp4_2d) the columnwise buffers TE derives
with NVFP4Tensor._create_columnwise() from our rowwise buffers.

One summary line per check is printed at the end of the module:
  crosscheck <format>: EXACT | MISMATCH <buffer> <n> elements (...) | SKIP <reason>
Skips (one line) without CUDA or without transformer_engine; imports happen inside fixtures.
"""

from __future__ import annotations

import math

import pytest
import torch

from qgather.formats import FORMATS

pytestmark = pytest.mark.gpu

LINES: dict[str, str] = {}

SHAPES = {
    "fp8_tensor": [(256, 512), (200, 304), (4, 64, 96)],
    "fp8_tensor_e5m2": [(256, 512), (200, 304), (4, 64, 96)],
    "fp8_block": [(256, 512), (200, 304), (2, 96, 160)],
    "fp8_block_1x128": [(256, 512), (200, 304), (2, 96, 160)],
    "mxfp8": [(256, 512), (96, 160), (2, 64, 96)],
    "nvfp4_1d": [(256, 512), (200, 304), (2, 48, 96)],
    "nvfp4_2d": [(256, 512), (200, 304), (2, 48, 96)],
}
DTYPES = (torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    yield
    lines = [LINES[k] for k in sorted(LINES)]
    if not lines:
        return
    capman = request.config.pluginmanager.getplugin("capturemanager")
    text = "\n" + "\n".join(lines) + "\n"
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print(text, flush=True)
    else:
        print(text, flush=True)


@pytest.fixture(scope="module")
def te():
    """The TE modules the checks use (skips the module without CUDA or TE)."""
    if not torch.cuda.is_available():
        for name in FORMATS:
            LINES[name] = f"crosscheck {name}: SKIP no CUDA device"
        pytest.skip("crosscheck: no CUDA device")
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401  (loads the extension)
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.custom_recipes import reference_utils
        from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef
        from transformer_engine.pytorch.quantization import is_mxfp8_available
        from transformer_engine.pytorch.tensor import (
            Float8BlockQuantizer,
            Float8CurrentScalingQuantizer,
            MXFP8Quantizer,
            NVFP4Quantizer,
        )
        from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Tensor
    except Exception as exc:  # ImportError, or the extension failing to load
        reason = f"transformer_engine unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        for name in FORMATS:
            LINES[name] = f"crosscheck {name}: SKIP {reason}"
        pytest.skip(f"crosscheck: {reason}")
    version = getattr(transformer_engine, "__version__", "?")
    if not str(version).startswith("2.20"):
        print(f"crosscheck: note: TransformerEngine {version}, the formats follow 2.20.2")
    return dict(tex=tex, Float8CurrentScalingQuantizer=Float8CurrentScalingQuantizer,
                Float8BlockQuantizer=Float8BlockQuantizer, MXFP8Quantizer=MXFP8Quantizer,
                NVFP4Quantizer=NVFP4Quantizer, NVFP4Tensor=NVFP4Tensor,
                NVFP4QuantizerRef=NVFP4QuantizerRef, reference_utils=reference_utils,
                is_mxfp8_available=is_mxfp8_available)


# ----------------------------------------------------------------------------- inputs


def make_input(shape, dtype, kind, seed):
    """'randn': normal values whose magnitude varies by 2^[-12, 12] across row and column groups (so
    blocks get different scales). 'extremes': zero blocks, E2M1/FP8 grid points, values near
    +-1e30 and 1e-30, and (fp32) subnormals. 'tiny': normal values * 1e-37 (per-tensor scales
    overflow to the float32 max, some subnormals). 'huge': values up to 3e38 (amax near f32 max)."""
    g = torch.Generator().manual_seed(seed)
    m, k = math.prod(shape[:-1]), shape[-1]
    if kind == "tiny":
        return (torch.randn(m, k, generator=g) * 1e-37).to(dtype).reshape(shape).cuda()
    if kind == "huge":
        return (torch.randn(m, k, generator=g).clamp(-5, 5) * 6e37).to(dtype).reshape(shape).cuda()
    row_mag = torch.exp2(torch.randint(-12, 13, (m // 16 + 1, 1), generator=g).float())
    row_mag = row_mag.repeat_interleave(16, dim=0)[:m]
    col_mag = torch.exp2(torch.randint(-3, 4, (1, k), generator=g).float())
    x = torch.randn(m, k, generator=g) * row_mag * col_mag
    if kind == "extremes":
        x[:32, :32] = 0.0
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75,
                             -2.5, -3.5, -5.0, -6.0])
        x[32:48, :] = grid.repeat(k // 16 + 1)[:k]
        x[48:64, : k // 2] = 1e30 * torch.randn(16, k // 2, generator=g)
        x[min(64, m - 16):min(80, m), k // 2:] = 1e-30 * torch.randn(min(80, m) - min(64, m - 16),
                                                                     k - k // 2, generator=g)
        if dtype == torch.float32:
            x[-2:, :] = 1e-39 * torch.randn(2, k, generator=g)
    return x.to(dtype).reshape(shape).cuda()


def cases(name):
    for i, shape in enumerate(SHAPES[name]):
        for dtype in DTYPES:
            for kind in ("randn", "extremes", "tiny", "huge"):
                if kind == "extremes" and math.prod(shape[:-1]) < 96:
                    continue
                yield f"{kind} {str(dtype).replace('torch.', '')} {tuple(shape)}", make_input(
                    shape, dtype, kind, seed=1000 + 10 * i)


# ----------------------------------------------------------------------------- comparison


def attr(obj, name, fmt):
    if not hasattr(obj, name):
        raise AssertionError(f"{fmt}: TE object {type(obj).__name__} has no attribute {name!r} "
                             f"(has {sorted(a for a in vars(obj) if a.startswith('_'))[:20]})")
    value = getattr(obj, name)
    if value is None:
        raise AssertionError(f"{fmt}: TE object {type(obj).__name__}.{name} is None")
    return value


def as_bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


class Report:
    """Collects differences for one format across all cases."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.diffs: list[tuple[str, int, str]] = []  # (buffer, n, detail)
        self.notes: list[str] = []

    def compare(self, case, buffer, ours, theirs):
        ours, theirs = as_bits(ours.detach()), as_bits(theirs.detach())
        if tuple(ours.shape) != tuple(theirs.shape):
            self.diffs.append((buffer, max(ours.numel(), theirs.numel()),
                               f"{case}: shape ours {tuple(ours.shape)} != TE {tuple(theirs.shape)}"))
            return
        if ours.dtype != theirs.dtype:
            self.diffs.append((buffer, ours.numel(), f"{case}: dtype ours {ours.dtype} != TE {theirs.dtype}"))
            return
        bad = (ours != theirs.to(ours.device)).nonzero()
        if bad.numel():
            idx = tuple(bad[0].tolist())
            self.diffs.append((buffer, bad.shape[0], f"{case}: first at {idx}: ours {ours[idx].item()} "
                                                     f"TE {theirs[idx].item()}"))

    def finish(self, label=None):
        label = label or self.fmt
        if not self.diffs:
            LINES[label] = f"crosscheck {label}: EXACT" + (f" ({'; '.join(self.notes)})" if self.notes else "")
            return
        buf, n, _ = self.diffs[0]
        total = sum(d[1] for d in self.diffs if d[0] == buf)
        LINES[label] = f"crosscheck {label}: MISMATCH {buf} {total} elements"
        detail = "\n".join(f"  {b}: {cnt} elements; {d}" for b, cnt, d in self.diffs[:25])
        pytest.fail(f"{label}: TE and qgather.formats differ\n{detail}", pytrace=False)


def ours_valid(q, buffer):
    return q.buffers[buffer][q.valid[buffer]]


def check_scale_shape(report, case, q, buffer, te_tensor):
    """TE's padded scale shape must equal ours (padding content is not compared)."""
    want = tuple(q.buffers[buffer].shape)
    if tuple(te_tensor.shape) != want:
        report.diffs.append((buffer + ".shape", 1, f"{case}: ours {want} != TE {tuple(te_tensor.shape)}"))


# ----------------------------------------------------------------------------- per format


def te_quantize(fmt_name, quantizer, x):
    try:
        return quantizer(x)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if fmt_name == "mxfp8":
            LINES[fmt_name] = f"crosscheck {fmt_name}: SKIP TE MXFP8 quantize failed: {msg}"
            pytest.skip(f"TE MXFP8 quantize failed on this GPU: {msg}")
        raise AssertionError(f"{fmt_name}: TE quantize raised for shape {tuple(x.shape)} "
                             f"{x.dtype}: {msg}") from exc


@pytest.mark.parametrize("fmt_name", ["fp8_tensor", "fp8_tensor_e5m2"])
def test_fp8_tensor(te, fmt_name):
    tex = te["tex"]
    fp8 = tex.DType.kFloat8E4M3 if fmt_name == "fp8_tensor" else tex.DType.kFloat8E5M2
    fmt, report = FORMATS[fmt_name], Report(fmt_name)
    for case, x in cases(fmt_name):
        quantizer = te["Float8CurrentScalingQuantizer"](fp8, device=torch.device("cuda"), rowwise=True,
                                                        columnwise=True)
        tq = te_quantize(fmt_name, quantizer, x)
        q = fmt.quantize(x)
        m, k = math.prod(x.shape[:-1]), x.shape[-1]
        report.compare(case, "data", q.buffers["data"], attr(tq, "_data", fmt_name).reshape(m, k))
        report.compare(case, "scale_inv", q.buffers["scale_inv"],
                       attr(tq, "_scale_inv", fmt_name).reshape(-1).to(torch.float32))
        transpose = getattr(tq, "_transpose", None)
        if transpose is not None and transpose.numel():
            report.compare(case, "transpose(data^T)", q.buffers["data"].t(), transpose.reshape(k, m))
    report.finish()


@pytest.mark.parametrize("fmt_name", ["fp8_block", "fp8_block_1x128"])
def test_fp8_block(te, fmt_name):
    fmt, report = FORMATS[fmt_name], Report(fmt_name)
    dim = 2 if fmt_name == "fp8_block" else 1
    for case, x in cases(fmt_name):
        quantizer = te["Float8BlockQuantizer"](te["tex"].DType.kFloat8E4M3, rowwise=True, columnwise=True,
                                               amax_epsilon=0.0, force_pow_2_scales=True,
                                               block_scaling_dim=dim)
        tq = te_quantize(fmt_name, quantizer, x)
        q = fmt.quantize(x)
        m, k = math.prod(x.shape[:-1]), x.shape[-1]
        report.compare(case, "rowwise_data", q.buffers["rowwise_data"],
                       attr(tq, "_rowwise_data", fmt_name).reshape(m, k))
        report.compare(case, "columnwise_data", q.buffers["columnwise_data"],
                       attr(tq, "_columnwise_data", fmt_name).reshape(k, m))
        for buf in ("rowwise_scale_inv", "columnwise_scale_inv"):
            t = attr(tq, "_" + buf, fmt_name)
            check_scale_shape(report, case, q, buf, t)
            report.compare(case, buf, ours_valid(q, buf), t[q.valid[buf]])
    report.finish()


def test_mxfp8(te):
    fmt_name = "mxfp8"
    # On sm_90 TE's MXFP8 quantize does not raise but returns uninitialized buffers (seen on an H200
    # with TE 2.20.2), so TE's own availability check decides.
    available, reason = te["is_mxfp8_available"](return_reason=True)
    if not available:
        LINES[fmt_name] = f"crosscheck {fmt_name}: SKIP TE: {reason}"
        pytest.skip(f"TE MXFP8 unavailable: {reason}")
    fmt, report = FORMATS[fmt_name], Report(fmt_name)
    for case, x in cases(fmt_name):
        quantizer = te["MXFP8Quantizer"](te["tex"].DType.kFloat8E4M3, rowwise=True, columnwise=True)
        tq = te_quantize(fmt_name, quantizer, x)
        torch.cuda.synchronize()
        q = fmt.quantize(x)
        m, k = math.prod(x.shape[:-1]), x.shape[-1]
        for buf in ("rowwise_data", "columnwise_data"):
            report.compare(case, buf, q.buffers[buf], attr(tq, "_" + buf, fmt_name).reshape(m, k))
        for buf in ("rowwise_scale_inv", "columnwise_scale_inv"):
            t = attr(tq, "_" + buf, fmt_name)
            check_scale_shape(report, case, q, buf, t)
            report.compare(case, buf, ours_valid(q, buf), t.view(torch.uint8)[q.valid[buf]])
    report.finish()


def nvfp4_ref(te, two_d):
    return te["NVFP4QuantizerRef"](dtype=te["reference_utils"].Fp4Formats.E2M1, rowwise=True, columnwise=True,
                                   pow_2_scales=False, eps=0.0,
                                   quant_tile_shape=(16, 16) if two_d else (1, 16), with_rht=False)


@pytest.mark.parametrize("fmt_name", ["nvfp4_1d", "nvfp4_2d"])
def test_nvfp4(te, fmt_name):
    fmt, report = FORMATS[fmt_name], Report(fmt_name)
    for case, x in cases(fmt_name):
        ref = te_quantize(fmt_name, nvfp4_ref(te, fmt_name == "nvfp4_2d"), x)
        q = fmt.quantize(x)
        m, k = math.prod(x.shape[:-1]), x.shape[-1]
        report.compare(case, "rowwise_data", q.buffers["rowwise_data"], attr(ref, "data", fmt_name))
        report.compare(case, "columnwise_data", q.buffers["columnwise_data"], attr(ref, "data_t", fmt_name))
        # the reference returns unpadded float8_e4m3fn scales (rows padded to 16 in 2-D mode)
        report.compare(case, "rowwise_scale_inv", ours_valid(q, "rowwise_scale_inv"),
                       attr(ref, "scale", fmt_name)[:m].view(torch.uint8))
        report.compare(case, "columnwise_scale_inv", ours_valid(q, "columnwise_scale_inv"),
                       attr(ref, "scale_t", fmt_name)[:k].view(torch.uint8))
        report.compare(case, "amax_rowwise", q.buffers["amax_rowwise"],
                       attr(ref, "global_amax_row", fmt_name).reshape(1).float())
        report.compare(case, "amax_columnwise", q.buffers["amax_columnwise"],
                       attr(ref, "global_amax_col", fmt_name).reshape(1).float())
    report.finish()


# ----------------------------------------------------------------------------- extra checks


def nvfp4_tensor_from(te, q, two_d, with_columnwise):
    """An NVFP4Tensor built from our buffers, 2-D (M, K) as TE's FSDP2 post-hook builds it."""
    quantizer = te["NVFP4Quantizer"](rowwise=True, columnwise=True, with_2d_quantization=two_d)
    b = q.buffers
    m, k = math.prod(q.shape[:-1]), q.shape[-1]
    return te["NVFP4Tensor"](
        shape=(m, k), dtype=torch.float32, fp4_dtype=te["tex"].DType.kFloat4E2M1,
        rowwise_data=b["rowwise_data"].clone(), rowwise_scale_inv=b["rowwise_scale_inv"].clone(),
        columnwise_data=b["columnwise_data"].clone() if with_columnwise else None,
        columnwise_scale_inv=b["columnwise_scale_inv"].clone() if with_columnwise else None,
        amax_rowwise=b["amax_rowwise"].clone(), amax_columnwise=b["amax_columnwise"].clone(),
        quantizer=quantizer, requires_grad=False, with_gemm_swizzled_scales=False,
        device=b["rowwise_data"].device)


def test_nvfp4_2d_te_columnwise_derivation(te):
    """TE's own columnwise derivation (NVFP4Tensor._create_columnwise: nibble-repacking transpose and
    2-D scale transpose), run on our rowwise buffers, must equal our columnwise buffers.
    Only M % 16 == 0 (as TE's FSDP2 hook asserts): TE's nvfp4_transpose kernel fails with a CUDA
    misaligned address for M = 200 (seen on an H200, TE 2.20.2), and that error is sticky."""
    label = "nvfp4_2d te-derived-columnwise"
    fmt, report = FORMATS["nvfp4_2d"], Report(label)
    for case, x in cases("nvfp4_2d"):
        if math.prod(x.shape[:-1]) % 16:
            continue
        q = fmt.quantize(x)
        try:
            t = nvfp4_tensor_from(te, q, two_d=True, with_columnwise=False)
            t._create_columnwise()
            torch.cuda.synchronize()
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            raise AssertionError(f"{label}: building NVFP4Tensor / _create_columnwise raised: {msg}") from exc
        k = x.shape[-1]
        report.compare(case, "columnwise_data", q.buffers["columnwise_data"],
                       attr(t, "_columnwise_data", label).reshape(k, -1))
        report.compare(case, "columnwise_scale_inv", ours_valid(q, "columnwise_scale_inv"),
                       attr(t, "_columnwise_scale_inv", label)[q.valid["columnwise_scale_inv"]])
        report.compare(case, "amax_columnwise", q.buffers["amax_columnwise"],
                       attr(t, "_amax_columnwise", label).reshape(1))
    report.finish(label)


@pytest.mark.parametrize("fmt_name", ["fp8_tensor", "fp8_block", "fp8_block_1x128", "nvfp4_1d", "nvfp4_2d"])
def test_dequantize_matches_te(te, fmt_name):
    """FORMATS[...].dequantize against TE's dequantize(dtype=float32) of the same bits."""
    label = f"{fmt_name} dequantize"
    fmt, report = FORMATS[fmt_name], Report(label)
    for case, x in cases(fmt_name):
        q = fmt.quantize(x)
        if fmt_name == "fp8_tensor":
            tq = te["Float8CurrentScalingQuantizer"](te["tex"].DType.kFloat8E4M3, device=torch.device("cuda"),
                                                     rowwise=True, columnwise=False)(x)
        elif fmt_name.startswith("fp8_block"):
            tq = te["Float8BlockQuantizer"](te["tex"].DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                            force_pow_2_scales=True,
                                            block_scaling_dim=2 if fmt_name == "fp8_block" else 1)(x)
        else:
            tq = nvfp4_tensor_from(te, q, two_d=fmt_name == "nvfp4_2d", with_columnwise=False)
        try:
            theirs = tq.dequantize(dtype=torch.float32)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            raise AssertionError(f"{label}: TE dequantize raised ({case}): {msg}") from exc
        ours, theirs = fmt.dequantize(q), theirs.reshape(x.shape)
        finite = torch.isfinite(theirs)
        if not bool(finite.all()):
            # TE's NVFP4 kernel computes float(s) * amax first, which overflows for amax near the
            # float32 max; ours switches to float(s) * (amax / 2688) there and stays finite.
            n = int((~finite).sum())
            report.notes.append(f"{case}: TE inf/NaN on {n} elements, ours finite")
            if not bool(torch.isfinite(ours).all()):
                report.diffs.append(("dequantize", n, f"{case}: ours not finite either"))
            ours, theirs = ours[finite], theirs[finite]
        report.compare(case, "dequantize", ours, theirs)
    if len(report.notes) > 2:
        report.notes = report.notes[:1] + [f"{len(report.notes) - 1} more such cases"]
    report.finish(label)
