"""Adapters that build the sharded module themselves (`make_sharded_module`), as TE's does; loaded
as `tests._own_route_adapters:<Name>` by tests/test_fsdp_setup.py, test_golden_cache.py and
test_weight_rows.py."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from qgather.impls.reference import ReferenceImplementation
from qgather.scenarios.module import QuantizedLinear, local_shard


class ConfiguredOwnRoute(ReferenceImplementation):
    """Builds its module itself and applies the case's configuration to fully_shard."""

    def make_sharded_module(self, ctx, spec, master, setup=None):
        weight = master.to(spec.torch_dtype)
        module = QuantizedLinear(self, self.make_param(spec.fmt, weight))
        fully_shard(module, **setup.kwargs)
        return module


class UnconfiguredOwnRoute(ReferenceImplementation):
    """Written before configurations existed: no `setup` parameter, FSDP2's defaults only."""

    def make_sharded_module(self, ctx, spec, master):
        weight = master.to(spec.torch_dtype)
        module = QuantizedLinear(self, self.make_param(spec.fmt, weight))
        fully_shard(module, mesh=ctx.mesh)
        return module


class WithTwin(ConfiguredOwnRoute):
    """Has a one-device twin, as TE's route does: the same layer on the rank's device alone, holding
    the full weight (`twins_built` counts them in this process)."""

    twins_built = 0

    def single_device_output(self, spec, weight, x):
        type(self).twins_built += 1
        return QuantizedLinear(self, self.make_param(spec.fmt, weight.to(x.device)))(x)

    def module_output(self, spec, module, x):
        return module(x)


class OwnRowsOnly(ReferenceImplementation):
    """Reads only its own rows of the master, as TE's route does: a placeholder module sharded by
    fully_shard, then its shard quantized from `setup.master_slice(master)` (a per-tensor amax
    all-reduced over the group, requantize_shard)."""

    reads_own_rows_only = True

    def make_sharded_module(self, ctx, spec, master, setup=None):
        placeholder = torch.ones(spec.shape, dtype=spec.torch_dtype, device=master.device)
        module = QuantizedLinear(self, self.make_param(spec.fmt, placeholder))
        fully_shard(module, **setup.kwargs)
        self.requantize_shard(local_shard(module), setup.master_slice(master).to(spec.torch_dtype), ctx.group)
        return module


class ClaimsOwnRowsOnly(ConfiguredOwnRoute):
    """Says it reads only its own rows but quantizes the full master: its other rows, when drawn
    only in part, are NaN and its gather cannot pass."""

    reads_own_rows_only = True
