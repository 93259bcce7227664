"""Adapters for the block scenario's own route (`make_block_layer`), loaded as
`tests._block_adapters:<Name>` by tests/test_block_scenario.py."""

from __future__ import annotations

import contextlib

import torch

from qgather.impls.reference import ReferenceImplementation
from qgather.scenarios.module import QuantizedLinear, harness_module, local_shard


class MaterializedAfterSharding(ReferenceImplementation):
    """Builds each block layer itself, as TE does: the layer holds a placeholder (zeros) until the block
    is sharded, then `materialize_block_layer` writes this rank's rows into its shard (TE's
    reset_parameters). A scenario that skipped the materialization would gather zeros."""

    def make_block_layer(self, ctx, spec, master, setup):
        module = QuantizedLinear(self, self.make_param(spec.fmt, torch.zeros_like(master).to(spec.torch_dtype)))
        module.pending = (setup.master_slice(master).to(spec.torch_dtype), ctx.group)
        return module

    def materialize_block_layer(self, module):
        rows, group = module.pending
        self.requantize_shard(local_shard(module), rows, group)
        del module.pending

    def single_device_output(self, spec, weight, x):
        return harness_module(self, spec.fmt, weight)(x)


class NeverMaterialized(MaterializedAfterSharding):
    """The same layers, never materialized: every gather holds the placeholder."""

    def materialize_block_layer(self, module):
        del module.pending


class CorruptsThePlainNorm(ReferenceImplementation):
    """A correct quantized path; its after-step hook zeroes this rank's shard of the block's plain norm
    weight (as a buggy optimizer hook might): the plain parameter's gather must be judged too."""

    def after_step(self, module, group):
        block = getattr(module, "block", module)
        local_shard(block.parts["norm"]).zero_()


class TwinInFloat32(MaterializedAfterSharding):
    """The same layers with a one-device twin that returns its output widened to float32, as TE's
    single_device_output does (TE's te.Linear itself returns the activations' dtype): the block's
    bias must be added to the twin's output as the sharded layer returns it, not in float32."""

    def single_device_output(self, spec, weight, x):
        return super().single_device_output(spec, weight, x).float()


class StateOnGradForward(MaterializedAfterSharding):
    """A recipe with state, as TE's DelayedScaling: leaving its forward context with autograd enabled
    updates a scale that every later forward reads (TE updates the amax history's scales at te.autocast's
    exit only under grad). The block runs no backward: its forward, like the one-device twin's, runs
    without autograd, so the state never changes and every point compares with the twin and the golden."""

    updated = False

    @contextlib.contextmanager
    def forward_context(self, spec):
        yield
        if torch.is_grad_enabled():
            type(self).updated = True

    def forward(self, param, x):
        y = super().forward(param, x)
        return y * 2 if type(self).updated else y
