"""A case's FSDP2 configuration (qgather.model.config) translated into what `fully_shard` gets: the mesh,
the MixedPrecisionPolicy, reshard_after_forward and shard_placement_fn; and what the golden and the
inspection need to know of it: which dimension is sharded over how many ranks, the dtype the
unsharded weight must have, and this rank's slice of the master weight. (Whether the shards fit the
format's blocks is shape arithmetic for the verdict policy: qgather.model.layout.)

The golden depends only on the shard dimension: under HSDP each replica holds the whole weight
sharded over the "shard" mesh dimension, so the shard layout is that of S ranks, not of R x S.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

from qgather.impls.base import Implementation
from qgather.model.case import DTYPES, CaseSpec, ColumnShardLayout, ShardLayout, shard_layout, shard_world_size
from qgather.model.layers import SCENARIO as LAYERS
from qgather.model.records import Stage
from qgather.runtime.rank import CaseContext

#: the settings fully_shard applies here (compile and DCP: qgather.scenarios.compiled, qgather.scenarios.checkpoint)
APPLIED = ("param_dtype", "reduce_dtype", "reshard_after_forward", "hsdp", "shard_dim")
#: scenarios without fully_shard: a configuration has nothing to apply to there
UNCONFIGURABLE = ("hooks", "virtual")


def param_dtype(spec: CaseSpec) -> torch.dtype:
    """The dtype of the unsharded weight: the policy's param_dtype, else the masters'."""
    return DTYPES[spec.config.param_dtype] if spec.config.param_dtype else spec.torch_dtype


def takes_setup(impl: Implementation) -> bool:
    """Whether the adapter's make_sharded_module takes the configuration (a `setup` parameter; the
    base class's does, so only an own route written without it does not)."""
    return "setup" in inspect.signature(impl.make_sharded_module).parameters


def skip_reason(spec: CaseSpec, impl: Implementation) -> str | None:
    """Why this configuration cannot run for this case (SKIPPED), or None."""
    config = spec.config
    if config.is_default:
        return None
    if spec.scenario in UNCONFIGURABLE:
        return (f"the {spec.scenario} scenario calls the hooks without fully_shard: configuration "
                f"{config.token} has nothing to apply to")
    layers = _layers_skip_reason(spec)
    if layers:
        return layers
    if not takes_setup(impl):
        return f"{impl.name} shards on its own route (make_sharded_module), which takes no FSDP2 configuration"
    reason = impl.config_skip_reason(spec)
    if reason:
        return reason
    if config.shard_dim == 1:
        if len(spec.shape) != 2:
            return "dim1: Shard(1) of a 3-D expert weight splits each expert's rows, not K (2-D weights only)"
        if spec.shape[-1] % shard_world_size(spec):
            return (f"dim1: FSDP2 requires even sharding on a nonzero dim (K={spec.shape[-1]} over "
                    f"{shard_world_size(spec)} ranks raises NotImplementedError in fully_shard)")
    raf, size = config.reshard_after_forward, shard_world_size(spec)
    if not isinstance(raf, bool) and size % raf:
        return f"raf-{raf}: FSDP2 needs an int reshard_after_forward that divides the shard world size {size}"
    if not isinstance(raf, bool) and 1 < raf < size:
        return (f"raf-{raf}: FSDP2 (torch {torch.__version__}) cannot re-gather a parameter with all-gather "
                "extensions from its post-forward reshard to a smaller mesh (FSDPParam.all_gather_inputs raises "
                "NotImplementedError in SHARDED_POST_FORWARD); raf-1 (= False) and raf-S (= True) run")
    return None


def _layers_skip_reason(spec: CaseSpec) -> str | None:
    """The configurations the layers scenario (qgather.scenarios.layers) does not run."""
    if spec.scenario != LAYERS:
        return None
    if spec.config.shard_dim == 1:
        return "dim1: the layers module holds a 3-D expert weight, and Shard(1) splits 2-D weights only"
    if spec.config.saved_at_world_size is not None:
        return "dcp-wsA: the layers scenario loads no checkpoint (the gather scenario does)"
    return None


# ------------------------------------------------------------------ on a rank
_MESHES: dict[tuple, DeviceMesh] = {}


def hsdp_mesh(ctx: CaseContext, replicate: int, shard: int) -> DeviceMesh:
    """The 2-D ("replicate", "shard") DeviceMesh over the pool's world, built once per pool."""
    key = (id(dist.distributed_c10d._get_default_group()), ctx.device.type, replicate, shard)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(ctx.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


@dataclass
class Setup:
    """What one rank needs to shard, gather and judge the case under its configuration."""

    kwargs: dict
    shards: ShardLayout | ColumnShardLayout
    shard_rank: int
    param_dtype: torch.dtype

    @property
    def shard_dim(self) -> int:
        """The sharded dimension: 1 under Shard(1) (`dim1`), else 0."""
        return getattr(self.shards, "shard_dim", 0)

    def master_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (master weight, gradient), as FSDP2 shards it."""
        if self.shard_dim == 1:
            start, end = self.shards.col_range(self.shard_rank)
            return full[:, start:end]
        start, end = self.shards.dim0_range(self.shard_rank)
        return full[start:end]

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
    if config.hsdp:
        mesh = hsdp_mesh(ctx, *config.hsdp)
        kwargs["mesh"] = mesh
        shard_rank = mesh.get_local_rank("shard")
    if config.param_dtype:
        reduce = DTYPES[config.reduce_dtype] if config.reduce_dtype else None
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[config.param_dtype], reduce_dtype=reduce)
    if config.reshard_after_forward is not True:
        kwargs["reshard_after_forward"] = config.reshard_after_forward
    if config.shard_dim == 1:
        kwargs["shard_placement_fn"] = lambda param: Shard(1)
    return Setup(kwargs, shard_layout(spec), shard_rank, param_dtype(spec))


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
