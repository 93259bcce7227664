"""TransformerEngine's own quantizers, with their outputs under the harness's buffer names.

Used where TE is the producer (golden entries, the TE adapters' own quantization). Needs a CUDA
GPU and transformer_engine; every function raises TEUnavailable with one line otherwise.
NVFP4 goes through TE's kernel-free reference quantizer (custom_recipes.reference_nvfp4), since
TE's NVFP4 kernels need sm_100. MXFP8 needs sm_100 too, and on sm_90 TE's quantize does not
raise but returns garbage buffers (seen on an H200), so availability is checked first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from qgather.errors import HarnessFault
from qgather.formats import FORMATS


class TEUnavailable(HarnessFault):
    """TE's quantizers cannot run in this process (no CUDA GPU, TE not importable, or this GPU lacks
    the format's kernels): the harness cannot ask TE, which is never the library refusing a shape."""


def _te():
    if not torch.cuda.is_available():
        raise TEUnavailable("TransformerEngine quantizers need a CUDA GPU")
    try:  # TE is optional: imported on use, its absence said in one line
        import transformer_engine.pytorch  # noqa: F401  (loads the extension)
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.custom_recipes import reference_utils
        from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef
        from transformer_engine.pytorch.tensor import (
            Float8BlockQuantizer,
            Float8CurrentScalingQuantizer,
            MXFP8Quantizer,
        )
    except Exception as exc:  # ImportError, or the extension failing to load
        raise TEUnavailable(f"transformer_engine unavailable: {type(exc).__name__}: {exc}") from None
    return tex, reference_utils, NVFP4QuantizerRef, Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer


def make_quantizer(fmt: str):
    """TE's quantizer for a harness format, configured as the harness format is defined."""
    tex, reference_utils, nvfp4_ref, block, current, mxfp8 = _te()
    if fmt in ("fp8_tensor", "fp8_tensor_e5m2"):
        dtype = tex.DType.kFloat8E4M3 if fmt == "fp8_tensor" else tex.DType.kFloat8E5M2
        return current(dtype, device=torch.device("cuda"), rowwise=True, columnwise=True)
    if fmt in ("fp8_block", "fp8_block_1x128"):
        return block(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, amax_epsilon=0.0,
                     force_pow_2_scales=True, block_scaling_dim=2 if fmt == "fp8_block" else 1)
    if fmt == "mxfp8":
        from transformer_engine.pytorch.quantization import is_mxfp8_available  # TE is optional: on use

        available, reason = is_mxfp8_available(return_reason=True)
        if not available:
            raise TEUnavailable(f"TE MXFP8: {reason}")
        return mxfp8(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
    if fmt in ("nvfp4_1d", "nvfp4_2d"):
        return nvfp4_ref(dtype=reference_utils.Fp4Formats.E2M1, rowwise=True, columnwise=True,
                         pow_2_scales=False, eps=0.0, with_rht=False,
                         quant_tile_shape=(16, 16) if fmt == "nvfp4_2d" else (1, 16))
    raise KeyError(f"no TransformerEngine quantizer for format {fmt!r}")


def te_quantize(fmt: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize `x` (on the GPU) with TE; buffers named, shaped and padded as qgather.formats."""
    quantized = make_quantizer(fmt)(x)
    torch.cuda.synchronize()
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    if fmt.startswith("fp8_tensor"):
        return {"data": _bytes(quantized._data).reshape(m, k),
                "scale_inv": quantized._scale_inv.reshape(1).float()}
    if fmt.startswith("fp8_block") or fmt == "mxfp8":
        columnwise_shape = (k, m) if fmt.startswith("fp8_block") else (m, k)
        return {"rowwise_data": _bytes(quantized._rowwise_data).reshape(m, k),
                "columnwise_data": _bytes(quantized._columnwise_data).reshape(columnwise_shape),
                "rowwise_scale_inv": _scale(quantized._rowwise_scale_inv),
                "columnwise_scale_inv": _scale(quantized._columnwise_scale_inv)}
    return _nvfp4_buffers(fmt, quantized, x)


def te_quantize_by_usage(fmt: str, x: torch.Tensor) -> Iterator[dict[str, torch.Tensor]]:
    """te_quantize of a blockwise FP8 or MXFP8 format one usage at a time (TE's quantizer with only
    rowwise, then only columnwise usage): each usage is computed on its own by TE, so the parts are
    the buffers of one pass with both usages, while only one usage is held at a time."""
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    for rowwise in (True, False):
        quantizer = make_quantizer(fmt)
        quantizer.set_usage(rowwise=rowwise, columnwise=not rowwise)
        quantized = quantizer(x)
        torch.cuda.synchronize()
        if rowwise:
            yield {"rowwise_data": _bytes(quantized._rowwise_data).reshape(m, k),
                   "rowwise_scale_inv": _scale(quantized._rowwise_scale_inv)}
        else:
            columnwise_shape = (k, m) if fmt.startswith("fp8_block") else (m, k)
            yield {"columnwise_data": _bytes(quantized._columnwise_data).reshape(columnwise_shape),
                   "columnwise_scale_inv": _scale(quantized._columnwise_scale_inv)}
        del quantized


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _scale(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else _bytes(t)


def _nvfp4_buffers(fmt: str, ref, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference quantizer returns unpadded scales; lay them into TE's padded shapes
    (the padding is zeros, as TE's kernels leave it; only the valid region carries TE's bits)."""
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    specs = FORMATS[fmt].buffer_specs(tuple(x.shape))
    valid = FORMATS[fmt].valid_regions(tuple(x.shape))
    out = {"rowwise_data": _bytes(ref.data).reshape(m, k // 2),
           "columnwise_data": _bytes(ref.data_t).reshape(k, m // 2),
           "amax_rowwise": ref.global_amax_row.reshape(1).float(),
           "amax_columnwise": ref.global_amax_col.reshape(1).float()}
    for name, source, rows in (("rowwise_scale_inv", ref.scale, m), ("columnwise_scale_inv", ref.scale_t, k)):
        shape, dtype = specs[name]
        padded = torch.zeros(shape, dtype=dtype, device=x.device)
        region = valid[name]
        padded[region] = _bytes(source[:rows]).reshape(padded[region].shape)
        out[name] = padded
    return out
