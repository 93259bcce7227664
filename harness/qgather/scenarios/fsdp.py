"""The gather, steps and reshard scenarios on the rank pool: the implementation's module under
`fully_shard`, unsharded by FSDP2 and inspected against the golden; steps and reshard then take
optimizer steps on the sharded masters (the golden the same steps on the full weight), re-quantize
the shards and inspect each re-gather (the `out=` path of the next unshard).

Before the first gather: the one-device twin's forward (its full-size module is gone before the
golden and the shards exist), a dcp-wsA case's checkpoint load (qgather.scenarios.checkpoint), and
for steps a re-quantization of the unchanged shards. After it, and after every optimizer step: a
compile case's eager and compiled forwards (qgather.scenarios.compiled), the weight each one's
unshard gathered judged against the golden like every other unshard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from qgather.check import host
from qgather.check.golden import Golden
from qgather.check.inspection import TwinOutput
from qgather.check.wire import record_wire, summarize_wire
from qgather.instruments.patches import hooks_moving_phase, pre_all_gather_observed
from qgather.model.case import CaseSpec
from qgather.model.phases import Phase, PhaseTracker, Step
from qgather.model.records import FIRST_UNSHARD, RankResult, Stage
from qgather.runtime.rank import CaseContext
from qgather.scenarios import checkpoint as checkpoint_reshard
from qgather.scenarios import fsdp_setup
from qgather.scenarios.compiled import CaseForward, compiled_stages
from qgather.scenarios.context import RankCase
from qgather.scenarios.data import Rows, draws_blockwise, make_gradient, make_weight
from qgather.scenarios.module import build_sharded_module, local_shard

STEPS = 3  # optimizer steps of the steps scenario (reshard takes one)
LEARNING_RATE = 0.05


def run_fsdp(ctx: CaseContext, spec: CaseSpec, phases: PhaseTracker, checkpoint: str | None = None) -> RankResult:
    """One gather, steps or reshard case on this rank, end to end."""
    case = RankCase.prepare(ctx, spec, phases, checkpoint)
    impl, fmt, setup, inspector = case.impl, case.fmt, case.setup, case.inspector
    # The one-device twin first: its full-size module is gone before the golden and the shards exist.
    # An earlier case of this weight, configuration and dtype on this rank may have left it.
    kept_twin = case.kept_twin()
    if spec.scenario in ("steps", "reshard"):
        master = make_weight(spec, ctx.device)
        weight = master.to(spec.torch_dtype)
        with phases.labelled(Step.TWIN):
            twin = kept_twin if kept_twin is not None else case.twin_output(weight)
    else:  # nothing steps the masters: a float32 copy would only hold memory
        waiting = make_weight(spec, ctx.device, spec.torch_dtype, rows=rows_to_draw(case, kept_twin))
        if kept_twin is None and inspector.builds_twin:  # a large weight waits on the host while the twin
            waiting = host.park_tensor(waiting)  # holds its own copy
        with phases.labelled(Step.TWIN):
            twin = kept_twin if kept_twin is not None else case.twin_output(waiting)
        master = weight = waiting.to(ctx.device)
        del waiting
    with phases.labelled(Step.GOLDEN):
        # a large golden waits on the host while the case gathers; kept for the next case of this weight
        golden = case.first_golden(weight)
    with phases.labelled(Step.SHARDED_MODULE):
        module = build_sharded_module(ctx, spec, phases, checkpoint_reshard.initial_master(spec, master), setup)
    weight_shape = setup.piece(weight).to("meta")  # what the wire summary reads of the gathered weight
    if spec.scenario == "gather":
        del master, weight  # the module holds its shard; a large weight's full copy would only hold memory
    loaded = checkpoint_reshard.load(ctx, spec, module, checkpoint, phases)
    if spec.scenario == "steps":
        _requantize_unchanged(case, module, master)
    param_types = (type(local_shard(module)),)
    with phases.at(Phase.SHARD), hooks_moving_phase(phases, param_types), aside_while_unsharding(golden, param_types):
        with impl.gather_context(ctx.group), record_wire(param_types) as wire:
            module.unshard()
    with phases.at(Phase.INSPECTION):
        first = inspector.judge(setup.unsharded(module.weight), golden, FIRST_UNSHARD, setup.param_dtype)
        with phases.labelled(Step.LIBRARY_FORWARD):
            checked = inspector.module_check(module, twin, setup.param_dtype)
        first = replace(first, module=checked, note=loaded)
    stages = [first]
    with phases.labelled(Step.RESHARD):
        module.reshard()
    compiled = CaseForward(case, module) if spec.config.compile else None  # one compile for the whole case
    if compiled is not None:
        stages.extend(compiled_stages(case, module, golden, compiled))
        module.reshard()  # a root's forward leaves its weight unsharded (FSDP2 keeps it for the backward)
    if spec.scenario in ("steps", "reshard"):
        stages.extend(_update_and_regather(case, module, master, compiled))
    summary = summarize_wire(wire, fmt, weight_shape, case.shards, golden, impl)
    return RankResult(ctx.rank, tuple(stages), summary, golden.quantizer_diffs or None)


@contextlib.contextmanager
def aside_while_unsharding(golden: Golden, param_types: tuple[type, ...]) -> Iterator[None]:
    """The block (the library's first unshard) runs with a large golden kept on a GPU stepped aside
    (Golden.step_aside): FSDP2's lazy initialization at the first unshard may hold the library's
    temporaries of several shards there (TE's blockwise FP8: 2 bf16 weights at 2 ranks, beside its
    shard's 0.5 and the golden's 0.5: `qgather bench gpu`'s fp8_block peak). Its way back starts once
    `param_types`' pre-all-gather hook has returned (the lazy initialization is done then), beside the
    collective; the inspection reads each check block once it is there. Where the block raises, the
    golden is back before the error leaves (it stays kept for the next case)."""
    if not golden.step_aside():
        yield
        return
    try:
        with pre_all_gather_observed(param_types, lambda inputs: golden.come_back()):
            yield
    except BaseException:
        golden.arrived()
        raise
    golden.come_back()  # where no pre-all-gather hook ran, the way back starts now


def rows_to_draw(case: RankCase, kept_twin: TwinOutput | None) -> Rows | None:
    """The rows of the weight a gather case needs drawn: this rank's shard rows where nothing else
    reads the weight, else None (all of them). Drawing only them saves a large weight's draw on every
    rank (`qgather bench gpu`: ~1.6 ms of kernels) once an earlier case keeps the golden and the twin.
    The shard rows only where every condition holds (the other rows are then NaN: a wrong one fails loudly):
      - the gather scenario with no checkpoint: steps and reshard step the full master (the golden
        takes the same steps); a loading case's checkpoint replaces the weight the module holds;
      - the golden kept (RankCase.golden_kept): first_golden then reads nothing of the weight, and
        nothing before it computes a golden that could evict it;
      - the twin kept, or none built (Inspector.builds_twin): the twin reads the full weight;
      - row sharding without tensor parallelism: the shard is then the rows
        shards.dim0_range(shard_rank) (setup.master_slice); a TP piece or Shard(1) columns are not;
      - the implementation builds its sharded module from those rows only (reads_own_rows_only): the
        harness's route quantizes the full weight before fully_shard cuts it;
      - a blockwise draw (data.draws_blockwise): elsewhere the whole weight is drawn anyway."""
    spec, setup, ctx = case.spec, case.setup, case.ctx
    if spec.scenario != "gather" or case.checkpoint is not None or spec.config.saved_at_world_size is not None:
        return None
    if not case.golden_kept() or (kept_twin is None and case.inspector.builds_twin):
        return None
    if setup.tp is not None or setup.shard_dim != 0 or not case.impl.reads_own_rows_only:
        return None
    return setup.shards.dim0_range(setup.shard_rank) if draws_blockwise(spec, ctx.device) else None


def _requantize_unchanged(case: RankCase, module: torch.nn.Module, master: torch.Tensor) -> None:
    """An optimizer step may come before the first gather (e.g. TE's `quantize_` into the sharded
    parameter): re-quantizing each shard from its own, unchanged master rows must leave the gathered
    weight as it was, the amax reduced over the shard group although no pre-hook has run yet."""
    impl, group = case.impl, case.ctx.group
    with torch.no_grad(), case.phases.at(Phase.STEP):
        impl.requantize_shard(local_shard(module), case.setup.master_slice(master).to(case.spec.torch_dtype), group)
        impl.after_step(module, group)


def _update_and_regather(case: RankCase, module: torch.nn.Module, master: torch.Tensor,
                         compiled: CaseForward | None) -> list[Stage]:
    """Optimizer steps on the sharded master rows, re-quantized on the shards, then the `out=`
    path of the next unshard (under `compile`, the eager and `compiled` forwards' own unshards);
    the golden takes the same steps on the full weight."""
    impl, spec, setup, phases, group = case.impl, case.spec, case.setup, case.phases, case.ctx.group
    inspector = case.inspector
    n_steps = STEPS if spec.scenario == "steps" else 1
    shard_master = torch.nn.Parameter(setup.master_slice(master).clone())
    full_param = torch.nn.Parameter(master.clone())
    opt_shard = torch.optim.SGD([shard_master], lr=LEARNING_RATE, momentum=0.9)
    opt_full = torch.optim.SGD([full_param], lr=LEARNING_RATE, momentum=0.9)
    stages = []
    for step in range(1, n_steps + 1):
        grad = make_gradient(spec, step, master.device)
        shard_master.grad, full_param.grad = setup.master_slice(grad).clone(), grad.clone()
        opt_shard.step()
        opt_full.step()
        with torch.no_grad(), phases.at(Phase.STEP):
            impl.requantize_shard(local_shard(module), shard_master.detach().to(spec.torch_dtype), group)
            impl.after_step(module, group)
            golden = case.golden(full_param.detach().to(spec.torch_dtype), parked=True)
        param_types = (type(local_shard(module)),)
        label = f"unshard {step + 1} (after step {step})"
        if setup.forward_gathers:
            def judge(weight, what, label=label, golden=golden):
                with phases.at(Phase.INSPECTION):
                    return inspector.judge(setup.unsharded(weight), golden, f"{label}, {what}", setup.param_dtype)

            with phases.at(Phase.STEP), hooks_moving_phase(phases, param_types), impl.gather_context(group):
                stages.extend(fsdp_setup.gather_through_forward(module, case.x.to(setup.param_dtype), judge))
        elif compiled is None:  # under compile, the forwards below gather it
            with phases.at(Phase.STEP), hooks_moving_phase(phases, param_types), impl.gather_context(group):
                module.unshard()
            with phases.at(Phase.INSPECTION):
                stage = inspector.judge(setup.unsharded(module.weight), golden, label, setup.param_dtype)
                twin = inspector.twin_output(full_param.detach().to(spec.torch_dtype), setup.param_dtype)
                stages.append(replace(stage, module=inspector.module_check(module, twin, setup.param_dtype)))
        if compiled is not None:
            stages.extend(compiled_stages(case, module, golden, compiled, f"after step {step}"))
        module.reshard()
    return stages
