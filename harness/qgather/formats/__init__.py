"""Quantized weight formats, bit-exact with TransformerEngine 2.20.2 (see docs/formats.md).

    from qgather.formats import FORMATS, Format, QuantizedTensor, FormatError
    fmt = FORMATS["nvfp4_2d"]
    q = fmt.quantize(x)                 # x: (..., K) float32/bfloat16, CPU or CUDA
    q = fmt.quantize(x, amax=t)         # per-tensor-scaled formats only (fp8_tensor*, nvfp4_*)
    q.format, q.shape, q.buffers, q.valid
    fmt.dequantize(q); fmt.dequantize_columnwise(q)
    rows, glob = fmt.to_rows(q); q2 = fmt.from_rows(rows, glob, q.shape)   # row layout for sharding

Formats: fp8_tensor, fp8_tensor_e5m2 (per-tensor current scaling), fp8_block (128x128 tiles),
fp8_block_1x128 (1-D 128 blocks), mxfp8, nvfp4_1d, nvfp4_2d. A format of your own (the protocol:
qgather.formats.base.Format) joins them through qgather.formats.registry: an adapter that lists it,
`--formats pkg.mod:Class`, or a `qgather.formats` entry point.
"""

from __future__ import annotations

import torch

from .base import Format, FormatError, QuantizedTensor
from .fp8_block import Fp8Block1DFormat, Fp8Block2DFormat
from .fp8_tensor import Fp8TensorFormat
from .mxfp8 import Mxfp8Format
from .numerics import FP8_E4M3_MAX, FP8_E5M2_MAX
from .nvfp4 import Nvfp4_1DFormat, Nvfp4_2DFormat
from .registry import FORMATS, FormatLoadError, load_entry_point_formats, load_format, register_format, user_formats

for _builtin in (
    Fp8TensorFormat("fp8_tensor", torch.float8_e4m3fn, FP8_E4M3_MAX),
    Fp8TensorFormat("fp8_tensor_e5m2", torch.float8_e5m2, FP8_E5M2_MAX),
    Fp8Block2DFormat(),
    Fp8Block1DFormat(),
    Mxfp8Format(),
    Nvfp4_1DFormat(),
    Nvfp4_2DFormat(),
):
    register_format(_builtin, builtin=True)

load_entry_point_formats()


def get_format(name: str) -> Format:
    """FORMATS[name], with a FormatError that lists the known names for an unknown one."""
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(f"unknown format {name!r}; choose from {', '.join(FORMATS)}") from None


__all__ = ["FORMATS", "Format", "FormatError", "FormatLoadError", "QuantizedTensor", "get_format", "load_format",
           "register_format", "user_formats"]
