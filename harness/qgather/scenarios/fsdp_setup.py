"""A case's FSDP2 configuration (qgather.model.config) translated into what `fully_shard` gets: the mesh,
the MixedPrecisionPolicy, reshard_after_forward and shard_placement_fn; and what the golden and the
inspection need to know of it: which dimension is sharded over how many ranks, the dtype the
unsharded weight must have, and this rank's slice of the master weight. (Whether the shards fit the
format's blocks is shape arithmetic for the verdict policy: qgather.model.layout.)

The golden depends only on the shard dimension: under HSDP each replica holds the whole weight
sharded over the "shard" mesh dimension, so the shard layout is that of S ranks, not of R x S.
Under tensor parallelism (`tp-DxT`) the weight is first distributed on the "tp" dimension
(qgather.scenarios.tensor_parallel), then FSDP2 shards each TP piece over "dp": the golden is the
full weight's, cut to this rank's TP piece, and the shard layout is that of the piece over D ranks.

Mixed precision: a quantized parameter's bits are its storage. FSDP2 never casts a subclass with
all-gather hooks (`_to_dtype_if_needed` is only applied on the plain path); it passes the policy to
`fsdp_pre_all_gather` and `param_dtype or orig_dtype` to `fsdp_post_all_gather`, whose result is the
unsharded parameter. So the gathered buffers are judged against q(W) of the masters as the case
built them (the reference's bits are quantized from them; torchao casts its high-precision shard
to float8 in its pre-hook), and the unsharded weight must carry the dtype the policy asks for:
`param_dtype`, so that the layer computes in it. A post-hook that ignores `param_dtype` leaves the
layer computing in the masters' dtype: a SILENT_MISMATCH. `reduce_dtype` is passed to
fully_shard; the scenarios gather frozen weights, so no gradient is reduced in it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

from qgather.impls.base import Implementation
from qgather.model.case import (
    CaseSpec,
    ColumnShardLayout,
    ShardLayout,
    shard_layout,
    tensor_parallel_layout,
    torch_dtype_of,
)
from qgather.model.config import FsdpConfig
from qgather.model.fsdp_rules import fsdp_skip_reason
from qgather.model.layers import MODULE_SCENARIOS
from qgather.model.records import Stage
from qgather.model.tp_rank import TensorParallelRank
from qgather.runtime.launch import detect_launch
from qgather.runtime.rank import CaseContext
from qgather.scenarios import tensor_parallel

#: the settings fully_shard applies here (compile and DCP: qgather.scenarios.compiled, qgather.scenarios.checkpoint;
#: the tensor-parallel distribution before it: qgather.scenarios.tensor_parallel)
APPLIED = ("param_dtype", "reduce_dtype", "reshard_after_forward", "hsdp", "tp", "tp_style", "shard_dim")
#: scenarios without fully_shard: a configuration has nothing to apply to there
UNCONFIGURABLE = ("hooks", "virtual")


def param_dtype(spec: CaseSpec) -> torch.dtype:
    """The dtype of the unsharded weight: the policy's param_dtype, else the masters'."""
    return torch_dtype_of(spec.config.param_dtype) if spec.config.param_dtype else spec.torch_dtype


def takes_setup(impl: Implementation) -> bool:
    """Whether the adapter's make_sharded_module takes the configuration (a `setup` parameter; the
    base class's does, so only an own route written without it does not)."""
    return "setup" in inspect.signature(impl.make_sharded_module).parameters


def skip_reason(spec: CaseSpec, impl: Implementation) -> str | None:
    """Why this configuration cannot run for this case (SKIPPED), or None."""
    config = spec.config
    if config.is_default:
        return None
    if spec.scenario == "virtual" and _tensor_parallel_only(config):
        return _tensor_parallel_skip(spec)  # the virtual scenario emulates the TP split too
    if spec.scenario in UNCONFIGURABLE:
        return (f"the {spec.scenario} scenario calls the hooks without fully_shard: configuration "
                f"{config.token} has nothing to apply to")
    reason = _tensor_parallel_skip(spec) or _two_dimensional_skip(spec) or _layers_skip_reason(spec)
    if reason:
        return reason
    if not takes_setup(impl):
        return f"{impl.name} shards on its own route (make_sharded_module), which takes no FSDP2 configuration"
    return impl.config_skip_reason(spec) or fsdp_skip_reason(spec)


def _tensor_parallel_only(config: FsdpConfig) -> bool:
    return config.tp is not None and replace(config, tp=None, tp_style="col").is_default


def _tensor_parallel_skip(spec: CaseSpec) -> str | None:
    """Why the case's tp-DxT cannot run (SKIPPED), or None: torch's styles split a linear layer's
    2-D weight, the harness splits the TP dimension evenly (every TP piece has one shape), and each
    rank splits its own copy of the weight (a torch without that gets no tp cases)."""
    tp = tensor_parallel_layout(spec)
    if tp is None:
        return None
    if len(spec.shape) != 2:
        return (f"{spec.config.token}: torch's tensor-parallel styles split a linear layer's 2-D weight; a 3-D "
                "expert weight is not split this way")
    if not tp.even:
        what = "M" if tp.dim == 0 else "K"
        return (f"{spec.config.token}: {what}={spec.shape[tp.dim]} is not a multiple of the tp size {tp.size} (the "
                "harness splits the TP dimension evenly)")
    if spec.config.compile:
        return f"{spec.config.token}: torch.compile of a tensor-parallel module is not part of the tp cases"
    if not tensor_parallel.SPLITS_LOCALLY and spec.scenario != "virtual":
        return f"{spec.config.token}: {tensor_parallel.NO_LOCAL_SPLIT}"
    return None


def _two_dimensional_skip(spec: CaseSpec) -> str | None:
    """A 2-D mesh (hsdp-RxS, tp-DxT) is built over the default process group: under torchrun or SLURM
    that is the whole job, so such a case runs only at the job's world size."""
    launch = detect_launch()
    if launch is None or not (spec.config.hsdp or spec.config.tp) or launch.world_size == spec.world_size:
        return None
    return (f"{spec.config.token}: its 2-D DeviceMesh spans the launched job's {launch.world_size} ranks; "
            f"the case has {spec.world_size}")


def _layers_skip_reason(spec: CaseSpec) -> str | None:
    """The configurations the layers and block scenarios (qgather.scenarios.layers, .block) do not run,
    and `nested` anywhere else."""
    scenario = spec.scenario
    if spec.config.nested and scenario != "block":
        return f"nested: the {scenario} scenario has no block to nest in a model root (the block scenario's)"
    if scenario not in MODULE_SCENARIOS:
        return None
    if spec.config.shard_dim == 1:
        return f"dim1: the {scenario} module holds a 3-D expert weight, and Shard(1) splits 2-D weights only"
    if spec.config.tp is not None:
        return (f"{spec.config.token}: the {scenario} module is not distributed on a tp mesh (the tp cases hold "
                "one weight)")
    if spec.config.saved_at_world_size is not None:
        return f"dcp-wsA: the {scenario} scenario loads no checkpoint (the gather scenario does)"
    return None


# ------------------------------------------------------------------ on a rank
_MESHES: dict[tuple, DeviceMesh] = {}


def mesh_2d(ctx: CaseContext, shape: tuple[int, int], names: tuple[str, str]) -> DeviceMesh:
    """A 2-D DeviceMesh over the pool's world (HSDP's ("replicate", "shard"), TP's ("dp", "tp")),
    built once per pool."""
    key = (id(dist.distributed_c10d._get_default_group()), ctx.device.type, shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    return _MESHES[key]


def hsdp_mesh(ctx: CaseContext, replicate: int, shard: int) -> DeviceMesh:
    """The 2-D ("replicate", "shard") DeviceMesh over the pool's world, built once per pool."""
    return mesh_2d(ctx, (replicate, shard), ("replicate", "shard"))


@dataclass
class Setup:
    """What one rank needs to shard, gather and judge the case under its configuration."""

    kwargs: dict
    shards: ShardLayout | ColumnShardLayout
    shard_rank: int
    param_dtype: torch.dtype
    tp: TensorParallelRank | None = None  # tp-DxT: this rank's TP piece and the "tp" mesh

    @property
    def shard_dim(self) -> int:
        """The sharded dimension: 1 under Shard(1) (`dim1`), else 0."""
        return getattr(self.shards, "shard_dim", 0)

    def master_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (master weight, gradient), as FSDP2 shards it (under
        tensor parallelism: FSDP2's shard of this rank's TP piece)."""
        if self.tp is not None:
            full = self.tp.piece(full)
        if self.shard_dim == 1:
            start, end = self.shards.col_range(self.shard_rank)
            return full[:, start:end]
        start, end = self.shards.dim0_range(self.shard_rank)
        return full[start:end]

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """What this rank gathers of a full tensor: its TP piece under tensor parallelism, else all of it."""
        return full if self.tp is None else self.tp.piece(full)

    def unsharded(self, weight: torch.Tensor) -> torch.Tensor:
        """The gathered weight the inspection compares: its local TP piece under tensor parallelism."""
        return weight if self.tp is None else tensor_parallel.local_piece(weight)

    @property
    def forward_gathers(self) -> bool:
        """Re-gathers go through the module's forward (and a backward-style unshard) so that
        reshard_after_forward decides what the next unshard starts from."""
        return self.kwargs.get("reshard_after_forward", True) is not True


def prepare(ctx: CaseContext, spec: CaseSpec) -> Setup:
    """The fully_shard kwargs, the shard layout and this rank's shard index for the case."""
    config = spec.config
    kwargs: dict = {"mesh": ctx.mesh}
    shard_rank = ctx.rank
    tp = None
    if config.hsdp:
        mesh = hsdp_mesh(ctx, *config.hsdp)
        kwargs["mesh"] = mesh
        shard_rank = mesh.get_local_rank("shard")
    if config.tp:
        mesh = mesh_2d(ctx, config.tp, ("dp", "tp"))
        kwargs["mesh"] = mesh["dp"]
        shard_rank = mesh.get_local_rank("dp")
        tp = TensorParallelRank(tensor_parallel_layout(spec), mesh.get_local_rank("tp"), mesh["tp"])
    if config.param_dtype:
        reduce = torch_dtype_of(config.reduce_dtype) if config.reduce_dtype else None
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch_dtype_of(config.param_dtype), reduce_dtype=reduce)
    if config.reshard_after_forward is not True:
        kwargs["reshard_after_forward"] = config.reshard_after_forward
    if config.shard_dim == 1:
        kwargs["shard_placement_fn"] = lambda param: Shard(1)
    return Setup(kwargs, shard_layout(spec), shard_rank, param_dtype(spec), tp)


def shard_numel(shards: ShardLayout | ColumnShardLayout, full_shape: tuple[int, ...]) -> int:
    """Elements of one rank's padded shard."""
    if isinstance(shards, ColumnShardLayout):
        return shards.dim0 * shards.col_chunk
    return shards.chunk * math.prod(full_shape[1:])


def gather_through_forward(module: torch.nn.Module, x: torch.Tensor,
                           judge: Callable[[torch.Tensor, str], Stage]) -> list[Stage]:
    """One training iteration's gathers under reshard_after_forward: the module's forward (FSDP2's
    pre-forward unshard, its post-forward reshard as configured), then the unshard backward's
    pre-hook does from whatever the forward left (SHARDED: the `out=` all-gather; raf=False: still
    unsharded; an int: the smaller post-forward mesh), then the post-backward reshard. `judge(weight,
    what)` inspects the unsharded weight in both places. The layer itself is not computed in the
    forward (torchao's needs torch._scaled_mm); the inspection computes it from the gathered weight."""
    stages = []

    def forward(*args, **kwargs):
        stages.append(judge(module.weight, "in forward"))
        return args[0]

    module.forward = forward
    try:
        module(x)
    finally:
        del module.forward
    module.unshard()
    stages.append(judge(module.weight, "backward's unshard"))
    module.reshard()
    return stages
