"""TE tensors seen through the harness's buffer names, and NVFP4Tensors built from reference bits."""

from __future__ import annotations

import math

import torch

from qgather.formats import FORMATS

ROWWISE_COLUMNWISE = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
                      "amax_rowwise", "amax_columnwise")


def read_te_buffers(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every buffer a TE quantized tensor holds, under the names of qgather.formats; a held buffer
    the format does not name (e.g. a stale transpose) is returned under its own name, so that the
    comparison with the golden reports it."""
    if hasattr(param, "_data") and not hasattr(param, "_rowwise_data"):
        return _float8_buffers(param)
    derive = getattr(param, "_columnwise_data", None) is None and hasattr(param, "_create_columnwise")
    if derive:  # TE derives columnwise only when the backward asks; ask for it as the backward would
        held_scales = getattr(param, "_columnwise_scale_inv", None)
        param._create_columnwise()
    out = {}
    for name in ROWWISE_COLUMNWISE:
        value = getattr(param, "_" + name, None)
        if value is not None:
            out[name] = value if value.dtype in (torch.uint8, torch.float32) else value.view(torch.uint8)
    if derive:  # the weight as the gather left it: the derived copy lives only as long as the caller's
        param._columnwise_data, param._columnwise_scale_inv = None, held_scales
    return out


def _float8_buffers(param: torch.Tensor) -> dict[str, torch.Tensor]:
    m, k = math.prod(param.shape[:-1]), param.shape[-1]
    data = param._data.view(torch.uint8).reshape(m, k)
    out = {"data": data, "scale_inv": param._scale_inv.reshape(1).float()}
    transpose = getattr(param, "_transpose", None)
    valid = not getattr(param, "_transpose_invalid", True)
    if transpose is not None and valid and not torch.equal(transpose.view(torch.uint8).reshape(k, m), data.t()):
        out["transpose (differs from data.t())"] = transpose.view(torch.uint8).reshape(k, m)
    return out


def nvfp4_tensor_from_bits(fmt: str, weight: torch.Tensor, quantizer, amax: torch.Tensor | None = None):
    """An NVFP4Tensor holding the harness's reference bits of `weight` (bit-exact with TE's
    reference quantizer), for GPUs without TE's NVFP4 kernels. `amax`: the global amax to scale
    with (the tensor's own amax when None)."""
    # TE is optional: imported on use
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Tensor

    q = FORMATS[fmt].quantize(weight, amax=amax) if amax is not None else FORMATS[fmt].quantize(weight)
    b = q.buffers
    return NVFP4Tensor(
        shape=tuple(weight.shape), dtype=weight.dtype, fp4_dtype=tex.DType.kFloat4E2M1,
        rowwise_data=b["rowwise_data"], rowwise_scale_inv=b["rowwise_scale_inv"],
        columnwise_data=b["columnwise_data"], columnwise_scale_inv=b["columnwise_scale_inv"],
        amax_rowwise=b["amax_rowwise"], amax_columnwise=b["amax_columnwise"],
        quantizer=quantizer, requires_grad=False, with_gemm_swizzled_scales=False,
        device=b["rowwise_data"].device)


#: the harness format whose row layout (Format.rowwise_rows) each TE storage class's rowwise buffers have
ROW_LAYOUTS = {"Float8TensorStorage": "fp8_tensor", "MXFP8TensorStorage": "mxfp8", "NVFP4TensorStorage": "nvfp4_2d"}


def row_layout_of(param: torch.Tensor):
    """The harness format that says how `param`'s rowwise buffers follow its rows, or None."""
    for cls in type(param).__mro__:
        if cls.__name__ == "Float8BlockwiseQTensorStorage":
            return FORMATS["fp8_block" if param._is_2D_scaled else "fp8_block_1x128"]
        if cls.__name__ in ROW_LAYOUTS:
            return FORMATS[ROW_LAYOUTS[cls.__name__]]
    return None


#: buffers of TE's storages that hold the columnwise (transposed) copy: a row slice leaves them out
COLUMNWISE_METADATA = ("columnwise_data", "columnwise_scale_inv", "data_transpose", "amax_columnwise")


def row_slice(param: torch.Tensor, fmt, start: int, stop: int):
    """A TE storage of `param`'s own class holding only the rows [start, stop) of its rowwise buffers
    (views, cut where qgather.formats says each buffer follows the rows: `fmt.rowwise_rows`), so
    that TE's own dequantize runs on one block of rows; None where TE's layout cannot be cut so
    (no rowwise buffers, scales swizzled for the GEMM, no storage class)."""
    storage = next((c for c in type(param).__mro__ if c.__name__.endswith("TensorStorage")), None)
    if storage is None or not fmt.rowwise_rows or getattr(param, "_with_gemm_swizzled_scales", False):
        return None
    meta = dict(param.get_metadata())
    rows = math.prod(param.shape[:-1])
    for name, (axis, per_entry) in fmt.rowwise_rows.items():
        buffer = meta.get(name)
        if buffer is None:
            return None
        # the last block keeps the buffer's padding rows: TE checks scale shapes against padded sizes
        first, last = start // per_entry, buffer.shape[axis] if stop == rows else -(-stop // per_entry)
        meta[name] = buffer.narrow(axis, first, last - first).contiguous()
    for name in COLUMNWISE_METADATA:
        if name in meta:
            meta[name] = None
    return storage(**meta)
