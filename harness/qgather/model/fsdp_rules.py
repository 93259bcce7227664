"""What FSDP2 itself (this torch) cannot run, read off a case alone: no implementation, no process
group. qgather.scenarios.fsdp_setup.skip_reason adds the implementation's own reasons and SKIPs
the case with either; qgather.suite.config_space derives from these rules which configurations,
shapes and regimes the configuration sweeps can pair.
"""

from __future__ import annotations

import torch

from qgather.model.case import CaseSpec, shard_world_size


def fsdp_skip_reason(spec: CaseSpec) -> str | None:
    """Why torch's fully_shard cannot run this case's configuration, or None."""
    config = spec.config
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
