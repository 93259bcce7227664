"""The reference's route: qgather's own tensor subclass (or a zoo mutant of it), carried in the script
as source (`SOURCES`: qgather's modules under the private package name `qref`, so that nothing
imports qgather), installed as modules, then sharded with fully_shard as any library's subclass
is. The golden is the same package's reference quantizer of the full weight."""

# ruff: noqa: F821 -- the script defines SOURCES, SHAPE, ... and the other pieces' functions (see __init__)

from __future__ import annotations

import importlib
import sys
import types

import torch
import torch.distributed as dist


def install(sources: dict[str, str]) -> None:
    """Every source as the module it names, a package before its modules."""
    for name in sorted(sources, key=lambda n: n.count(".")):
        module = sys.modules[name] = types.ModuleType(name)
        if any(other.startswith(name + ".") for other in sources):  # a package
            module.__package__, module.__path__ = name, []
        else:
            module.__package__ = name.rpartition(".")[0]
        if "." in name:
            setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], module)
    for name, source in sources.items():
        exec(compile(source, f"<{name}>", "exec"), sys.modules[name].__dict__)


class ReferenceLinear(torch.nn.Linear):
    """A bias-free linear layer whose weight is the subclass (an nn.Linear: torch's TP styles apply)."""

    def __init__(self, weight: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[-1], weight.shape[0]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight.transpose(-1, -2))


def layer_reference(master: torch.Tensor, rank: int, device: torch.device, size: int, mesh) -> torch.nn.Module:
    """The subclass (PARAM_CLASS) holding the full weight in a linear layer; under TP torch's own style on "tp"."""
    from qref.formats import FORMATS  # the carried package (SOURCES)

    module_name, _, class_name = PARAM_CLASS.partition(":")
    param_class = getattr(importlib.import_module(module_name), class_name)
    layer = ReferenceLinear(param_class.from_weight(FORMATS[FORMAT], master.to(device, DTYPE)))
    if TP:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(layer, mesh["tp"], RowwiseParallel() if TP_DIM else ColwiseParallel(), src_data_rank=None)
    return layer


def read_reference(weight: torch.Tensor, want: dict) -> dict:
    """The gathered buffers in TransformerEngine's layout (`_te`): in TE's padded shape, their valid
    regions; in any other shape, whole (the evidence then names the shape)."""
    from qref.formats import FORMATS

    fmt, shape = FORMATS[FORMAT], tuple(weight.shape)
    return {name: buffer[fmt.valid_regions(shape)[name]] if tuple(buffer.shape) == fmt.buffer_specs(shape)[name][0]
            else buffer for name, buffer in weight._te.items()}


def requantize_reference(module: torch.nn.Module, rows: torch.Tensor) -> None:
    """The reference adapter's optimizer step (ReferenceImplementation.requantize_shard): the shard
    re-quantized from its rows, per-tensor formats with the amax of the whole weight."""
    from qref.formats import FORMATS

    local, fmt = module.weight.to_local(), FORMATS[FORMAT]
    amax = None
    if local._glob:  # per-tensor values: all-reduce the shards' amaxes
        amax = rows.abs().amax().float() if rows.numel() else rows.new_zeros((), dtype=torch.float32)
        for group in module.weight.device_mesh.get_all_groups():  # over every rank of the mesh
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    if rows.shape[0] == 0:  # a rank with zero rows keeps the per-tensor values every rank agrees on
        probe = rows.new_zeros((fmt.row_block * 2, rows.shape[-1]))
        local._assign({}, fmt.to_rows(fmt.quantize(probe, amax=amax))[1] if amax is not None else {})
    else:
        local._assign(*fmt.to_rows(fmt.quantize(rows, amax=amax) if amax is not None else fmt.quantize(rows)))


def quantize(w: torch.Tensor, per_tensor_amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference quantizer's buffers of the weight (per-tensor formats: with the whole weight's
    amax), their valid regions."""
    from qref.formats import FORMATS

    fmt = FORMATS[FORMAT]
    q = fmt.quantize(w, amax=per_tensor_amax) if fmt.per_tensor else fmt.quantize(w)
    return {name: buffer[q.valid[name]] for name, buffer in q.buffers.items()}


def dequantize(q: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values of valid-region buffers, by the reference's own dequantization."""
    from qref.formats import FORMATS, QuantizedTensor

    fmt, valid = FORMATS[FORMAT], FORMATS[FORMAT].valid_regions(shape)
    buffers = {}
    for name, (padded, dtype) in fmt.buffer_specs(shape).items():
        buffers[name] = torch.zeros(padded, dtype=dtype)
        if buffers[name][valid[name]].shape != q[name].shape:
            return torch.empty(0)  # a buffer in another layout (the evidence says which): no values
        buffers[name][valid[name]] = q[name].cpu()
    return fmt.dequantize(QuantizedTensor(FORMAT, shape, buffers, valid))
