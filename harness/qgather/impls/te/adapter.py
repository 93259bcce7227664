"""What every TE adapter shares (`TEAdapter`): how TE refuses, how its tensors are read, dequantized,
re-quantized and multiplied, and the skips that follow from TE being absent or the GPU lacking
a kernel. The adapters differ only in how the sharded parameter comes to exist."""

from __future__ import annotations

import torch

from qgather.formats import FORMATS, FormatError
from qgather.impls.base import Implementation
from qgather.impls.te.environment import has_nvfp4_kernels, mxfp8_unavailable_reason, sm_name, te_import_error
from qgather.impls.te.quantizers import te_quantize, te_quantize_by_usage
from qgather.impls.te.tensors import read_te_buffers, row_layout_of, row_slice
from qgather.model.case import CaseSpec, ColumnShardLayout, saved_spec, shard_layout, tensor_parallel_layout

NVFP4 = ("nvfp4_1d", "nvfp4_2d")


class TEAdapter(Implementation):
    devices = ("cuda",)
    scenarios = ("gather", "steps", "reshard")
    # TE refuses in its FSDP2 hooks with an assertion that names the constraint (NVFP4's shard_M % 16;
    # FSDP2's own AssertionErrors are not TE refusing) and NotImplementedError (1-D block scaling).
    rejection_types = ("AssertionError: FSDP2 requires", "NotImplementedError")

    def skip_reason(self, spec: CaseSpec, device: torch.device) -> str | None:
        reason = super().skip_reason(spec, device)
        if spec.fmt in self.formats and spec.scenario in self.scenarios and device.type not in self.devices:
            missing = te_import_error()  # TE's own reason too, where it is not even importable
            return f"{reason} ({missing})" if missing else reason
        reason = reason or te_import_error() or self.route_skip_reason(spec)
        if reason:
            return reason
        if len(spec.shape) != 2:
            return f"{self.name}: te.Linear weights are 2-D; 3-D expert weights are not built by this adapter"
        if spec.fmt == "mxfp8":
            return mxfp8_unavailable_reason()
        if spec.fmt in NVFP4 and not has_nvfp4_kernels():
            return self._nvfp4_stand_in_skip(spec)
        return None

    def _nvfp4_stand_in_skip(self, spec: CaseSpec) -> str | None:
        """Below sm_100 qgather builds TE's NVFP4 shards from its reference bits (te.reference_bits),
        which hold only shards the format holds (rows in pairs, K a multiple of 16): any other shard is
        one only TE's kernel can build."""
        if spec.scenario != "gather":
            return f"{self.name}: re-quantizing NVFP4 shards needs TE's sm_100 kernels (this GPU is {sm_name()})"
        for case in (spec, saved_spec(spec)) if spec.config.saved_at_world_size else (spec,):
            for rank, shape in enumerate(_shard_shapes(case)):
                try:
                    FORMATS[spec.fmt].check(shape)
                except FormatError as exc:
                    return (f"{self.name}: on {sm_name()} qgather builds TE's NVFP4 shards from its reference bits, "
                            f"which cannot hold rank {rank}'s {shape} shard at world size {case.world_size} "
                            f"({exc}); only TE's sm_100 kernel can say what TE does with it")
        return None

    def route_skip_reason(self, spec: CaseSpec) -> str | None:
        """A reason this adapter's route cannot build `spec` although TE imports."""
        return None

    def own_quantization(self, fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """TE's quantization of the full weight, which the golden is cross-checked against. None for
        NVFP4 on a GPU without TE's NVFP4 kernels: the shards there are the reference bits themselves,
        so there is no TE quantizer in the case to check (TE's Python reference quantizer agrees with
        the reference formats bit for bit, tests/gpu/test_te_crosscheck.py; run whole on a large
        weight, it held 11x the weight's bf16 size)."""
        if fmt in NVFP4 and not has_nvfp4_kernels():
            return None
        return te_quantize(fmt, weight.cuda())

    def own_quantization_parts(self, fmt: str, weight: torch.Tensor):
        """TE's quantization one usage at a time for the formats that hold two (blockwise FP8, MXFP8),
        so that the golden's cross-check never holds two full quantizations of a large weight."""
        if fmt.startswith("fp8_block") or fmt == "mxfp8":
            if fmt == "mxfp8" and mxfp8_unavailable_reason():
                return super().own_quantization_parts(fmt, weight)  # te_quantize says why, in one line
            return te_quantize_by_usage(fmt, weight.cuda())
        return super().own_quantization_parts(fmt, weight)

    def read_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return read_te_buffers(param)

    def requantize_shard(self, local: torch.Tensor, master_rows: torch.Tensor, group) -> None:
        # TE's pre-hook set local.amax_reduction_group, so current scaling all-reduces the amax.
        local.quantize_(master_rows.to(local.device))

    def is_quantized(self, param: torch.Tensor) -> bool:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor  # TE is optional: imported on use

        return isinstance(param, QuantizedTensor)

    def own_dequantize(self, param: torch.Tensor) -> torch.Tensor:
        return param.dequantize(dtype=torch.float32)

    def own_dequantize_blocks(self, param: torch.Tensor, fmt, blocks: list[tuple[int, int]]):
        """TE's own dequantization of each row block, run on a TE tensor of the same class holding
        only those rows (tensors.row_slice); one whole dequantization where TE's layout cannot be cut."""
        first = row_slice(param, fmt, *blocks[0]) if len(blocks) > 1 else None
        if first is None:
            return super().own_dequantize_blocks(param, fmt, blocks)
        return ((first if index == 0 else row_slice(param, fmt, start, stop)).dequantize(dtype=torch.float32)
                for index, (start, stop) in enumerate(blocks))

    def forward(self, param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self._dequantized_in(param, x.dtype).transpose(-1, -2))

    def forward_rows(self, param: torch.Tensor, x: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
        fmt = row_layout_of(param)
        if fmt is None or param.dim() != 2:
            return None
        rows = row_slice(param, fmt, start, stop)
        if rows is None:
            return None
        return self.forward_own_rows(x, rows.dequantize(dtype=torch.float32))

    def forward_own_rows(self, x: torch.Tensor, own_rows: torch.Tensor) -> torch.Tensor:
        # The same rounding as _dequantized_in: TE's float32 rows, then the layer's dtype.
        return torch.matmul(x, own_rows.to(x.dtype).transpose(-1, -2))

    def _dequantized_in(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """TE's dequantization of the weight in the layer's dtype. A large weight is dequantized to
        float32 row block by row block and rounded into one buffer: TE's own dequantize(dtype=...)
        of some classes goes through a whole float32 copy first (the same rounding, 3x the memory)."""
        fmt = row_layout_of(param)
        blocks = fmt.check_blocks(tuple(param.shape)) if fmt is not None else []
        if len(blocks) <= 1:
            return param.dequantize(dtype=dtype)
        out = torch.empty(tuple(param.shape), dtype=dtype, device=param.device)
        rows = out.view(blocks[-1][1], -1)
        for (start, stop), values in zip(blocks, self.own_dequantize_blocks(param, fmt, blocks), strict=True):
            rows[start:stop] = values
        return out


def _shard_shapes(spec: CaseSpec) -> list[tuple[int, int]]:
    """Each FSDP2 shard's (rows, columns) of a 2-D weight, under the case's tensor parallelism too
    (every rank's TP piece has one shape); empty shards left out (the stand-in builds those)."""
    tp = tensor_parallel_layout(spec)
    cols = tp.piece_shape()[1] if tp is not None else spec.shape[-1]
    layout = shard_layout(spec)
    if isinstance(layout, ColumnShardLayout):
        return [(layout.dim0, layout.col_chunk)] * layout.world_size
    shapes = []
    for rank in range(layout.world_size):
        start, end = layout.row_range(rank)
        if end > start:
            shapes.append((end - start, cols))
    return shapes
