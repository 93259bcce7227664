"""Checkpoint resharding on the ranks (`dcp-wsA` in the id of a case of world size B): the FSDP2
module's state dict (a DTensor of the quantized subclass) saved with torch.distributed.checkpoint at
world size A (`save_on_rank`), loaded at world size B (`load`), then gathered and compared with the
golden like any case.

The runner's side (a directory per case, the save run on the A pool before the case, its verdict
when it fails) is qgather.engine.checkpoint. The loading module is built from ANOTHER weight (other
values and another amax: `initial_master`), so that a load that writes nothing, or that loses a
per-tensor scale, cannot pass; `load` reads the checkpoint into it (`dcp.load` in place, then
`load_state_dict`, as training code does). A `dcp-wsA-trained` save's training forward gathers the
weight at A: that weight is judged against the golden too (a wrong one fails the case, saying so).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed.checkpoint as dcp

from qgather.model.case import CaseSpec, saved_spec
from qgather.model.phases import Phase, PhaseTracker
from qgather.model.records import RankResult, Stage
from qgather.runtime.rank import CaseContext
from qgather.scenarios import fsdp_setup
from qgather.scenarios.context import RankCase
from qgather.scenarios.data import make_weight
from qgather.scenarios.fsdp_setup import param_dtype
from qgather.scenarios.judging import judged_in_forward
from qgather.scenarios.module import build_sharded_module

#: seed offset of the weight a loading module starts from (never the checkpoint's)
DECOY_SEED = 7919
DECOY_SCALE = 4.0  # another amax too: a per-tensor scale the load fails to write stays visibly wrong


def initial_master(spec: CaseSpec, master: torch.Tensor) -> torch.Tensor:
    """What the module is built from: the case's master, or for a loading case a decoy of the same
    shape (another seed, scaled), which the checkpoint must overwrite."""
    if spec.config.saved_at_world_size is None:
        return master
    return make_weight(replace(spec, seed=spec.seed + DECOY_SEED), master.device) * DECOY_SCALE


def load(ctx: CaseContext, spec: CaseSpec, module: torch.nn.Module, checkpoint: str | None,
         phases: PhaseTracker) -> str:
    """Read the checkpoint into the sharded module (nothing without one); returns a note for the report."""
    if checkpoint is None:
        return ""
    with phases.at(Phase.LOAD):
        state = module.state_dict()
        dcp.load(state, checkpoint_id=checkpoint, process_group=ctx.group)
        module.load_state_dict(state)
    types = ", ".join(f"{name} {_type_name(t)}" for name, t in state.items())
    files = len([f for f in os.listdir(checkpoint) if f.endswith(".distcp")])
    trained = " after a training forward" if spec.config.saved_after_forward else ""
    return (f"loaded through torch.distributed.checkpoint, saved at world size {spec.config.saved_at_world_size}"
            f"{trained} "
            f"({files} .distcp files): {types}")


def save_on_rank(ctx: CaseContext, case: CaseSpec, checkpoint: str) -> RankResult:
    """On every rank of the A pool: build and shard the case's module at world size A (for
    `dcp-wsA-trained`: then run one training forward of it, the weight its unshard gathered judged
    against the golden like any other) and save its state dict into the directory `checkpoint`.
    Returns the training forward's stage (none without one), noting what was saved."""
    phases = PhaseTracker()
    with phases.tagging():
        spec = saved_spec(case)
        setup = fsdp_setup.prepare(ctx, spec)
        module = build_sharded_module(ctx, spec, phases, setup=setup)
        stages: list[Stage] = []
        if case.config.saved_after_forward:
            with phases.at(Phase.FORWARD):
                stages = _training_forward(RankCase.prepare(ctx, spec, phases), module)
        with phases.at(Phase.SAVE):
            state = module.state_dict()
            dcp.save(state, checkpoint_id=checkpoint, process_group=ctx.group)
        saved = ", ".join(f"{name} {_type_name(t)}" for name, t in state.items())
        return RankResult(ctx.rank, tuple(replace(stage, note=f"saved: {saved}") for stage in stages))


def _training_forward(case: RankCase, module: torch.nn.Module) -> list[Stage]:
    """One forward of the sharded module as a training step runs it (FSDP2's unshard, the library's
    own forward under its context, e.g. te.autocast), then the reshard a root's forward skips. The
    weight the forward received is judged against the golden (cut to this rank's TP piece under
    tensor parallelism) where the forward receives it."""
    ctx, spec, impl, setup = case.ctx, case.spec, case.impl, case.setup
    golden = case.golden(make_weight(spec, ctx.device, spec.torch_dtype))
    inspector = case.inspector
    label = "the training forward's unshard"  # the runner names the save (qgather.engine.checkpoint)
    stages: list[Stage] = []
    with judged_in_forward([module], lambda m: inspector.judge(setup.unsharded(m.weight), golden, label,
                                                               param_dtype(spec)),
                           case.phases, stages), impl.gather_context(ctx.group), impl.forward_context(spec):
        module(case.x.to(spec.torch_dtype))  # a rowwise TP rank's: its K / T columns of the input
    module.reshard()
    return stages


def _type_name(t: object) -> str:
    local = getattr(t, "_local_tensor", None)
    return f"{type(t).__name__}({type(local).__name__})" if local is not None else type(t).__name__
