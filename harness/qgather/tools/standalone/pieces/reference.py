"""The reference's route: qgather's own tensor subclass (or a zoo mutant of it), carried in the script
as source (`SOURCES`: qgather's modules under the private package name `qref`, so that nothing
imports qgather), installed as modules, then sharded with fully_shard and gathered as any library's
subclass is. The golden is the same package's reference quantizer of the full weight."""

# ruff: noqa: F821 -- the script defines SOURCES, SHAPE, ..., and the other pieces' functions (see __init__)

from __future__ import annotations

import importlib
import sys
import types

import torch


def install(sources: dict[str, str]) -> None:
    """Every source as the module it names, in order (a package's own code where its names are ready)."""
    for name in sorted(sources, key=lambda n: n.count(".")):  # a package before its modules
        module = types.ModuleType(name)
        module.__package__ = name if any(other.startswith(name + ".") for other in sources) else name.rpartition(".")[0]
        if module.__package__ == name:
            module.__path__ = []
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    for name, source in sources.items():
        exec(compile(source, f"<{name}>", "exec"), sys.modules[name].__dict__)


def gathered_reference(rank: int, device: torch.device):
    """The subclass's full weight as a module's parameter, fully_shard, unshard: the gathered buffers
    in TransformerEngine's layout (`_te`), their valid regions."""
    from qref.formats import FORMATS  # the carried package (SOURCES)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module_name, _, class_name = PARAM_CLASS.partition(":")
    param_class = getattr(importlib.import_module(module_name), class_name)
    weight = make_weight(SHAPE, SEED, DTYPE).to(device)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(param_class.from_weight(FORMATS[FORMAT], weight), requires_grad=False)
    fully_shard(module, mesh=init_device_mesh(device.type, (WORLD_SIZE,)))
    module.unshard()
    fmt, want = FORMATS[FORMAT], quantize(weight.cpu())
    got = {}
    for name, buffer in module.weight._te.items():
        padded = fmt.buffer_specs(SHAPE)[name][0]
        if tuple(buffer.shape) == padded:  # TE's padded layout: then only the valid region counts
            got[name] = buffer[fmt.valid_regions(SHAPE)[name]]
        else:  # compared whole, so that the evidence names the shape TE would not accept
            got[name], want[name] = buffer, torch.zeros(padded, dtype=want[name].dtype)
    return "all rows", 0, got, want


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
