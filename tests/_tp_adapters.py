"""Helpers of tests/test_tp.py that must be importable on the rank pools: an adapter
whose own route ignores tensor parallelism, and a probe of the sharded module's placements."""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from qgather.impls.reference import ReferenceImplementation
from qgather.model.case import CaseSpec
from qgather.model.phases import PhaseTracker
from qgather.scenarios import fsdp_setup
from qgather.scenarios.module import QuantizedLinear, build_sharded_module


class IgnoresTensorParallel(ReferenceImplementation):
    """Builds its module itself and shards the FULL weight over the "dp" mesh it is handed: each
    rank's gather is the whole weight where its TP piece belongs."""

    def make_sharded_module(self, ctx, spec, master, setup=None):
        module = QuantizedLinear(self, self.make_param(spec.fmt, master.to(spec.torch_dtype)))
        fully_shard(module, **setup.kwargs)
        return module


def sharded_placements(ctx, case_id: str) -> dict:
    """On a rank: the case's module as the harness shards it, and what its weight is before and
    after an unshard (mesh dimension names, placements, local shapes, this rank's coordinates)."""
    spec = CaseSpec.parse(case_id)
    setup = fsdp_setup.prepare(ctx, spec)
    module = build_sharded_module(ctx, spec, PhaseTracker(), setup=setup)
    sharded = module.weight
    module.unshard()
    unsharded = module.weight
    out = {
        "mesh": tuple(sharded.device_mesh.mesh_dim_names),
        "sharded": _placements(sharded),
        "local": tuple(sharded._local_tensor.shape),
        "unsharded": _placements(unsharded),
        "piece": tuple(setup.unsharded(unsharded).shape),
        "global": tuple(unsharded.shape),
        "dp": setup.shard_rank,
        "tp": setup.tp.rank,
    }
    module.reshard()
    return out


def _placements(dtensor) -> tuple:
    """(class name, dim, split factor) of each placement (their str differs between torch releases)."""
    return tuple((type(p).__name__, p.dim, getattr(p, "split_factor", None)) for p in dtensor.placements)
