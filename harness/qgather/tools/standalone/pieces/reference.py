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


def sharded_reference(rank: int, device: torch.device):
    """The subclass (PARAM_CLASS) holding the full weight as a module's parameter, fully_shard: the
    module and the float32 weight."""
    from qref.formats import FORMATS  # the carried package (SOURCES)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module_name, _, class_name = PARAM_CLASS.partition(":")
    param_class = getattr(importlib.import_module(module_name), class_name)
    weight = make_weight(SHAPE, SEED, torch.float32)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(param_class.from_weight(FORMATS[FORMAT], weight.to(device, DTYPE)),
                                       requires_grad=False)
    fully_shard(module, mesh=init_device_mesh(device.type, (WORLD_SIZE,)))
    return module, weight


def read_reference(module, want: dict) -> dict:
    """The gathered buffers in TransformerEngine's layout (`_te`): in TE's padded shape, their valid
    regions; in any other shape, whole (the evidence then names the shape)."""
    from qref.formats import FORMATS

    fmt = FORMATS[FORMAT]
    return {name: buffer[fmt.valid_regions(SHAPE)[name]] if tuple(buffer.shape) == fmt.buffer_specs(SHAPE)[name][0]
            else buffer for name, buffer in module.weight._te.items()}


def requantize_reference(module, rows: torch.Tensor) -> None:
    """The reference adapter's optimizer step (ReferenceImplementation.requantize_shard): the shard
    re-quantized from its rows, per-tensor formats with the amax of the whole weight."""
    from qref.formats import FORMATS

    local, fmt = module.weight.to_local(), FORMATS[FORMAT]
    amax = None
    if local._glob:  # per-tensor values: all-reduce the shards' amaxes
        amax = rows.abs().amax().float() if rows.numel() else rows.new_zeros((), dtype=torch.float32)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    if rows.shape[0] == 0:  # a rank with zero rows keeps the per-tensor values every rank agrees on
        probe = rows.new_zeros((fmt.row_block * 2, rows.shape[-1]))
        local._assign({}, fmt.to_rows(fmt.quantize(probe, amax=amax))[1] if amax is not None else {})
    else:
        local._assign(*fmt.to_rows(fmt.quantize(rows, amax=amax) if amax is not None else fmt.quantize(rows)))


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference quantizer's buffers of the full weight, their valid regions."""
    from qref.formats import FORMATS

    q = FORMATS[FORMAT].quantize(w)
    return {name: buffer[q.valid[name]] for name, buffer in q.buffers.items()}


def dequantize(q: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 values of valid-region buffers, by the reference's own dequantization."""
    from qref.formats import FORMATS, QuantizedTensor

    fmt, valid = FORMATS[FORMAT], FORMATS[FORMAT].valid_regions(SHAPE)
    buffers = {}
    for name, (shape, dtype) in fmt.buffer_specs(SHAPE).items():
        buffers[name] = torch.zeros(shape, dtype=dtype)
        if buffers[name][valid[name]].shape != q[name].shape:
            return torch.empty(0)  # a buffer in another layout (the evidence says which): no values
        buffers[name][valid[name]] = q[name].cpu()
    return fmt.dequantize(QuantizedTensor(FORMAT, SHAPE, buffers, valid))
