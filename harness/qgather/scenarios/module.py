"""The module under FSDP2: the implementation's own sharded module, or qgather's bias-free linear
layer over its quantized parameter, sharded with `fully_shard` as the case's configuration says
(under tp-DxT: first distributed on the "tp" mesh dimension, qgather.scenarios.tensor_parallel).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from qgather.check.claim import check_claimed_format
from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.impls.base import Implementation
from qgather.model.case import CaseSpec
from qgather.model.phases import Phase, PhaseTracker
from qgather.runtime.rank import CaseContext
from qgather.scenarios import fsdp_setup, tensor_parallel
from qgather.scenarios.data import make_weight


class QuantizedLinear(torch.nn.Linear):
    """A bias-free linear layer whose weight is the implementation's quantized parameter. An
    nn.Linear, so that torch's tensor-parallel styles (which distribute only nn.Linear and
    nn.Embedding) apply to it; built without nn.Linear's own (high-precision) weight."""

    def __init__(self, impl: Implementation, weight: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[-1], weight.shape[0]
        self.impl = impl
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through the implementation's own forward of its quantized weight."""
        return self.impl.forward(self.weight, x)


def build_sharded_module(ctx: CaseContext, spec: CaseSpec, phases: PhaseTracker, master: torch.Tensor | None = None,
                         setup: fsdp_setup.Setup | None = None) -> torch.nn.Module:
    """The implementation's module holding the quantized `master` (default: the case's), sharded by FSDP2
    as the case's configuration says (`setup`, default: fsdp_setup.prepare)."""
    impl = get_impl(spec.impl)
    master = make_weight(spec, ctx.device) if master is None else master
    setup = setup or fsdp_setup.prepare(ctx, spec)
    module = own_sharded_module(impl, ctx, spec, master, setup)
    if module is None:
        module = harness_module(impl, spec.fmt, master.to(spec.torch_dtype))
        with phases.at(Phase.SHARD):
            if setup.tp is not None:  # tensor parallel first, then FSDP2 on "dp" (as TP + FSDP2 users do)
                tensor_parallel.distribute(impl, module, setup.tp)
            fully_shard(module, **setup.kwargs)
    return module


def own_sharded_module(impl: Implementation, ctx: CaseContext, spec: CaseSpec, master: torch.Tensor,
                       setup: fsdp_setup.Setup) -> torch.nn.Module | None:
    """The module the library builds and shards itself (`make_sharded_module`), or None: the harness's route."""
    if fsdp_setup.takes_setup(impl):
        return impl.make_sharded_module(ctx, spec, master, setup)
    # an adapter written before configurations: FSDP2's defaults only (fsdp_setup.skip_reason)
    return impl.make_sharded_module(ctx, spec, master)


def harness_module(impl: Implementation, fmt: str, weight: torch.Tensor) -> torch.nn.Module:
    """The unsharded module the harness's route builds from the full `weight`: the library's own
    module (`make_module`), else qgather's linear layer over `make_param`."""
    module = impl.make_module(fmt, weight) or QuantizedLinear(impl, impl.make_param(fmt, weight))
    check_claimed_format(impl, FORMATS[fmt], module.weight)  # before any data moves
    return module


def local_shard(module: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of the module's weight (the DTensor's local tensor)."""
    weight = module.weight
    return weight._local_tensor if hasattr(weight, "_local_tensor") else weight
