"""The hooks scenario on the rank pool: the subclass's FSDP2 hooks around a direct all-gather of
each input's bytes, without fully_shard (FSDP2's chunking, padded shard and padded-size rule
emulated: qgather.scenarios.emulation), the unsharded weight inspected against the golden.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qgather.check.golden import golden_for
from qgather.check.wire import record_wire, summarize_wire
from qgather.errors import HarnessFault
from qgather.model.case import CaseSpec
from qgather.model.phases import Phase, PhaseTracker
from qgather.model.records import RankResult
from qgather.runtime.rank import CaseContext
from qgather.scenarios.context import RankCase
from qgather.scenarios.data import make_weight
from qgather.scenarios.emulation import check_padded_inputs, fsdp2_chunks, pre_all_gather, shard_like_fsdp2


def run_hooks(ctx: CaseContext, spec: CaseSpec, phases: PhaseTracker, checkpoint: str | None = None) -> RankResult:
    """One hooks case on this rank: shard as FSDP2 does, pre-hook, all-gather, post-hook, inspect."""
    if spec.config.compile or checkpoint:
        raise HarnessFault(f"{spec.config.token} needs fully_shard; the hooks scenario has none")
    case = RankCase.prepare(ctx, spec, phases, checkpoint)
    impl, fmt, shards = case.impl, case.fmt, case.shards
    weight = make_weight(spec, ctx.device, spec.torch_dtype)
    golden = golden_for(fmt, weight, impl)
    param = impl.make_param(spec.fmt, weight)
    with phases.at(Phase.SHARD):
        local = shard_like_fsdp2(param, fsdp2_chunks(param, ctx.world_size)[ctx.rank], shards)
    with record_wire((type(local),)) as wire:
        with phases.at(Phase.PRE_HOOK):
            inputs, metadata = pre_all_gather(local, ctx.mesh, weight.shape)
            check_padded_inputs(local, inputs, shards, weight.shape)
        with phases.at(Phase.COLLECTIVE):
            outputs = [_all_gather_bytes(t, ctx.world_size, ctx.group) for t in inputs]
    with phases.at(Phase.POST_HOOK):
        unsharded, _ = local.fsdp_post_all_gather(tuple(outputs), metadata, weight.dtype)
    with phases.at(Phase.INSPECTION):
        stage = case.inspector.judge(unsharded, golden, "hooks")
    summary = summarize_wire(wire, fmt, weight, shards, golden, impl)
    return RankResult(ctx.rank, (stage,), summary, golden.quantizer_diffs or None)


def _all_gather_bytes(t: torch.Tensor, world_size: int, group: dist.ProcessGroup) -> torch.Tensor:
    # gloo rejects float8 dtypes: move bytes, then view them back as the input's dtype.
    src = t.contiguous().view(torch.uint8).reshape(-1)
    out = src.new_empty(src.numel() * world_size)
    dist.all_gather_into_tensor(out, src, group=group)
    return out.view(t.dtype).reshape(t.shape[0] * world_size, *t.shape[1:])
