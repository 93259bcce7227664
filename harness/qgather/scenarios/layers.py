"""The layers scenario on the rank pool: a module of several quantized linear weights
(qgather.model.layers derives them: the case's shape, an aligned weight, a 3-D expert weight), each
built through the implementation's own route (make_sharded_module, make_module or make_param) and
`fully_shard`-ed, then the root, as users shard a model. State one weight leaves behind for the next
(a cache keyed too coarsely, a class-level layout) cannot show in a case of one weight.

Each weight is first gathered alone, right after it is built (FSDP2's unshard of its layer), and
judged against its own golden, bytes and values, with its own wire check; that is where a refusal
shows. Then an iteration: the module's forward (FSDP2's pre-forward unshard of every layer in turn,
through `out=`; each gathered weight judged where its layer receives it), the outputs and the loss
against the same module on one device, then the backward's unshard of every layer in reverse (from
whatever the forward left) judged again, and the reshard. One iteration runs before the first step
(after every shard was re-quantized from its unchanged masters: an optimizer step before any
forward) and one after each of STEPS optimizer steps (SGD on the full masters, every shard
re-quantized from its rows of them; the goldens and the one-device module take the same steps).
Under `compile` the forward is `torch.compile(module)`'s.

A weight the implementation refuses while it is built, sharded or first gathered (its declared
rejection, raised on every rank before its data moved) is left out of the module, and the rest runs:
the case is REJECTED only if the policy accepts that refusal (the weight is not aligned:
qgather.model.policy) and everything else is EXACT (qgather.engine.classify). A weight refused on
some ranks only fails the case (ERROR; one refused in its pre-all-gather hook on some ranks only
leaves the others in the all-gather: whatever the runtime then sees, HANG included). A weight the
implementation does not hold (its skip_reason, e.g. torchao's 3-D experts) is left out with a note.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from qgather.check.golden import Golden, golden_for
from qgather.check.inspection import Inspector
from qgather.check.wire import record_wire, summarize_wire
from qgather.errors import HarnessFault
from qgather.instruments.patches import hooks_moving_phase
from qgather.model.case import CaseSpec
from qgather.model.layers import LayerWeight, layer_weights
from qgather.model.phases import BEFORE_DATA_MOVED, Phase, PhaseTracker
from qgather.model.policy import refusal_accepted
from qgather.model.records import BufferDiff, RankResult, Stage, WireSummary
from qgather.runtime.rank import CaseContext
from qgather.scenarios import fsdp_setup
from qgather.scenarios.compiled import CaseForward
from qgather.scenarios.context import RankCase
from qgather.scenarios.data import make_gradient, make_weight
from qgather.scenarios.judging import judged_in_forward
from qgather.scenarios.module import harness_module, local_shard, own_sharded_module

STEPS = 2
LEARNING_RATE = 0.05


class RefusedElsewhere(Exception):
    """Raised on the ranks that built a weight other ranks refused: the ranks disagree."""


class Layers(torch.nn.Module):
    """The module under test: one layer per weight, all fed the same input; the forward returns every
    layer's output, in order."""

    def __init__(self, layers: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict(layers)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [layer(x) for layer in self.layers.values()]


@dataclass
class Layer:
    """One weight of the module on this rank: its sharded layer and what judges it."""

    weight: LayerWeight
    module: torch.nn.Module
    setup: fsdp_setup.Setup
    inspector: Inspector
    masters: list[torch.Tensor]  # the full float32 masters before step 1 and after each step
    own_route: bool  # the library built and sharded it itself (make_sharded_module)

    def golden(self, point: int) -> Golden:
        return golden_for(self.inspector.fmt, self.masters[point].to(self.weight.spec.torch_dtype),
                          self.inspector.impl)


def run_layers(ctx: CaseContext, spec: CaseSpec, phases: PhaseTracker, checkpoint: str | None = None) -> RankResult:
    """One layers case on this rank, end to end."""
    if checkpoint is not None:
        raise HarnessFault(f"case {spec.id}: the layers scenario loads no checkpoint")
    case = RankCase.prepare(ctx, spec, phases, checkpoint)
    layers, stages, wires = _build_layers(case)
    if not layers:
        return RankResult(ctx.rank, tuple(stages), wires=tuple(wires))
    module = Layers({layer.weight.name: layer.module for layer in layers})
    with phases.at(Phase.SHARD):
        fully_shard(module, **case.setup.kwargs)
    twin = _twin_outputs(case, layers)
    if isinstance(twin, str):
        stages[-1] = _noted(stages[-1], twin)
    goldens = [layer.golden(0) for layer in layers]
    iteration = _Iteration(case, module, layers, twin if isinstance(twin, list) else None)
    for point in range(STEPS + 1):
        _requantize(case, module, layers, point)
        stages += iteration.run(point, goldens if point == 0 else [layer.golden(point) for layer in layers])
    return RankResult(ctx.rank, tuple(stages), None, _quantizer_diffs(layers, goldens), wires=tuple(wires))


def _noted(stage: Stage, note: str) -> Stage:
    return replace(stage, note="; ".join(filter(None, (stage.note, note))))


# ------------------------------------------------------------------ building, and the first gather
def _build_layers(case: RankCase) -> tuple[list[Layer], list[Stage], list[WireSummary]]:
    """Every weight the implementation holds, built, sharded and first gathered alone: the layers
    (in module order), the stages (first gathers and refusals) and each first gather's wire summary."""
    layers: list[Layer] = []
    stages: list[Stage] = []
    wires: list[WireSummary] = []
    notes = []
    for weight in layer_weights(case.spec):
        skip = case.impl.skip_reason(weight.spec, case.ctx.device)
        if skip:
            notes.append(f"{weight.title} left out: {skip}")
            continue
        built = _build(case, weight)
        if isinstance(built, Layer):
            built = _first_gather(case, built, stages, wires)
        (stages if isinstance(built, Stage) else layers).append(built)
    if notes:
        stages[0] = _noted(stages[0], "; ".join(notes))
    return layers, stages, wires


def _build(case: RankCase, weight: LayerWeight) -> Layer | Stage:
    """The weight's sharded layer, or the stage of its refusal when every rank refused it."""
    ctx, phases, impl = case.ctx, case.phases, case.impl
    masters = _masters(weight, ctx.device)
    setup = fsdp_setup.prepare(ctx, weight.spec)
    refusal: Exception | None = None
    own_route = False
    try:
        with phases.at(Phase.BUILD):
            module = own_sharded_module(impl, ctx, weight.spec, masters[0], setup)
            own_route = module is not None
            if module is None:
                module = harness_module(impl, weight.spec.fmt, masters[0].to(weight.spec.torch_dtype))
                with phases.at(Phase.SHARD):
                    fully_shard(module, **setup.kwargs)
    except Exception as exc:  # noqa: BLE001 - a declared refusal is recorded; anything else is raised
        refusal = _declared_refusal(case, exc)
    refused = _agreed_refusal(case, weight, refusal)
    if refused is not None:
        return refused
    inspector = Inspector(weight.spec, impl, case.fmt, case.x, setup.shards)
    return Layer(weight, module, setup, inspector, masters, own_route)


def _first_gather(case: RankCase, layer: Layer, stages: list[Stage], wires: list[WireSummary]) -> Layer | Stage:
    """The layer's first unshard, alone: its weight judged (appended to `stages`) with its own wire
    summary (appended to `wires`); or the stage of a refusal its pre-all-gather hook raised on every rank."""
    phases, impl = case.phases, case.impl
    types = (type(local_shard(layer.module)),)
    refusal: Exception | None = None
    golden = layer.golden(0)
    try:
        with phases.at(Phase.SHARD), hooks_moving_phase(phases, types), impl.gather_context(case.ctx.group), \
                record_wire(types) as wire:
            layer.module.unshard()
    except Exception as exc:  # noqa: BLE001 - a declared refusal is recorded; anything else is raised
        refusal = _declared_refusal(case, exc)
    refused = _agreed_refusal(case, layer.weight, refusal)
    if refused is not None:
        return refused
    with phases.at(Phase.INSPECTION):
        stages.append(layer.inspector.judge(layer.module.weight, golden, f"{layer.weight.title}: its first unshard",
                                            layer.setup.param_dtype))
    layer.module.reshard()
    weight = layer.masters[0].to(device="meta", dtype=layer.weight.spec.torch_dtype)
    wires.append(summarize_wire(wire, case.fmt, weight, layer.setup.shards, golden, impl, label=layer.weight.title))
    return layer


def _declared_refusal(case: RankCase, exc: Exception) -> Exception:
    """`exc` when it is one of the implementation's declared refusals, raised before any of the
    weight's data moved; anything else is raised again, as in any scenario."""
    if case.impl.refusal_problem(exc) or case.phases.current.value not in BEFORE_DATA_MOVED:
        raise exc
    return exc


def _agreed_refusal(case: RankCase, weight: LayerWeight, refusal: Exception | None) -> Stage | None:
    """The stage of a refusal every rank raised (None: no rank refused); raised when some ranks only refused."""
    return _refusal_stage(case, weight, refusal, _refusing_ranks(case.ctx, [refusal is not None])[0])


def _refusal_stage(case: RankCase, weight: LayerWeight, refusal: Exception | None, refusing: list[int]) -> Stage | None:
    """`_agreed_refusal` once the ranks agreed on who refused the weight (`refusing`)."""
    ctx = case.ctx
    if refusing and len(refusing) < ctx.world_size:
        if refusal is not None:
            raise refusal
        raise RefusedElsewhere(f"{weight.title} was refused on ranks {','.join(map(str, refusing))} only; "
                               "this rank built and sharded it")
    if refusal is None:
        return None
    line = f"{type(refusal).__name__}: {(str(refusal).strip().splitlines() or [''])[0][:200]}"
    return Stage(f"{weight.title}: left out of the module", refused=line,
                 refusal_accepted=refusal_accepted(weight.spec))


def _masters(weight: LayerWeight, device: torch.device) -> list[torch.Tensor]:
    """The weight's full float32 masters before step 1 and after each of STEPS SGD steps (elementwise:
    a shard's rows of them are what the same steps on the shard's rows give)."""
    param = torch.nn.Parameter(make_weight(weight.spec, device) * weight.scale)
    optimizer = torch.optim.SGD([param], lr=LEARNING_RATE, momentum=0.9)
    masters = [param.detach().clone()]
    for step in range(1, STEPS + 1):
        param.grad = make_gradient(weight.spec, step, device) * weight.scale
        optimizer.step()
        masters.append(param.detach().clone())
    return masters


def _refusing_ranks(ctx: CaseContext, refused: list[bool]) -> list[list[int]]:
    """Per weight, the ranks that refused it (every rank agrees on the lists before anything moves):
    one collective for all the weights given."""
    flags = torch.zeros(len(refused), ctx.world_size, dtype=torch.int32, device=ctx.device)
    flags[:, ctx.rank] = torch.tensor([int(r) for r in refused], dtype=torch.int32)
    dist.all_reduce(flags, group=ctx.group)
    return [[rank for rank, flag in enumerate(row) if flag] for row in flags.tolist()]


# ------------------------------------------------------------------ the one-device module
def _twin_outputs(case: RankCase, layers: list[Layer]) -> list[torch.Tensor] | str:
    """What the same module computes on one device holding the full weights, at every point (before
    step 1, after each step): the loss and the outputs, flattened; or why there is nothing to compare."""
    spec, impl = case.spec, case.impl
    if case.setup.param_dtype != spec.torch_dtype:
        return (f"outputs not compared with a one-device module: it has no mixed-precision policy to compute "
                f"in {case.setup.param_dtype} (each weight's gather and layer output are judged)")
    x = case.x.to(spec.torch_dtype)
    points = []
    for point in range(STEPS + 1):
        outputs = []
        for layer in layers:
            weight = layer.masters[point].to(spec.torch_dtype)
            with torch.no_grad(), impl.forward_context(spec):
                if layer.own_route:
                    output = impl.single_device_output(layer.weight.spec, weight, x)
                    if output is None:
                        return (f"outputs not compared with a one-device module: {impl.name} builds "
                                f"{layer.weight.title} itself and has no single_device_output")
                else:
                    output = harness_module(impl, spec.fmt, weight)(x)
            outputs.append(output)
        points.append(_flat(outputs))
    return points


def _flat(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The loss (the sum of the outputs' mean squares) and every output, as one float32 vector."""
    loss = sum(y.float().pow(2).mean() for y in outputs)
    return torch.cat([loss.detach().reshape(1), *(y.detach().float().flatten() for y in outputs)])


# ------------------------------------------------------------------ one iteration
class _Iteration:
    """The module's forward, its outputs against the one-device module's, and the backward's unshard."""

    def __init__(self, case: RankCase, module: Layers, layers: list[Layer], twin: list[torch.Tensor] | None) -> None:
        self.case, self.module, self.layers, self.twin = case, module, layers, twin
        self.param_types = tuple(dict.fromkeys(type(local_shard(layer.module)) for layer in layers))
        self.forward = CaseForward(case, module)

    def run(self, point: int, goldens: list[Golden]) -> list[Stage]:
        """The stages of one iteration at `point` (0: before step 1, k: after step k)."""
        case, phases, impl = self.case, self.case.phases, self.case.impl
        when = "before step 1" if point == 0 else f"after step {point}"
        by_module = {id(layer.module): (layer, golden) for layer, golden in zip(self.layers, goldens)}

        def judge(module: torch.nn.Module) -> Stage:
            layer, golden = by_module[id(module)]
            label = f"{when}: {layer.weight.title}, the forward's unshard"
            return layer.inspector.judge(module.weight, golden, label, layer.setup.param_dtype)

        stages: list[Stage] = []
        with phases.at(Phase.FORWARD), hooks_moving_phase(phases, self.param_types), \
                impl.gather_context(case.ctx.group), impl.forward_context(case.spec), \
                judged_in_forward([layer.module for layer in self.layers], judge, phases, stages,
                                  compiled=self.forward.compiled):
            outputs = self.forward(case.x.to(case.spec.torch_dtype))
        stages += self._outputs_stage(when, point, outputs)
        return stages + self._backward_unshards(when, goldens)

    def _outputs_stage(self, when: str, point: int, outputs: list[torch.Tensor]) -> list[Stage]:
        """The outputs and loss against the one-device module's (nothing when there is none to compare
        with), or the error of a compiled forward that ran no compiled graph."""
        label = f"{when}: the module's outputs and loss against the same module on one device"
        expected = self.twin[point] if self.twin is not None else None
        return self.forward.outputs_stage(label, "module", _flat(outputs), expected)

    def _backward_unshards(self, when: str, goldens: list[Golden]) -> list[Stage]:
        """Every layer re-gathered in reverse, as the backward's pre-hooks do, from whatever the forward left."""
        phases, impl, group = self.case.phases, self.case.impl, self.case.ctx.group
        stages = []
        for layer, golden in reversed(list(zip(self.layers, goldens))):
            with phases.at(Phase.STEP), hooks_moving_phase(phases, self.param_types), impl.gather_context(group):
                layer.module.unshard()
            with phases.at(Phase.INSPECTION):
                stages.append(layer.inspector.judge(layer.module.weight, golden,
                                                    f"{when}: {layer.weight.title}, the backward's unshard",
                                                    layer.setup.param_dtype))
            layer.module.reshard()
        self.module.reshard()
        return stages


def _requantize(case: RankCase, module: Layers, layers: list[Layer], point: int) -> None:
    """Every shard re-quantized from its rows of the masters at `point` (0: unchanged, before any
    gather), then the implementation's after-step hook on the whole module."""
    impl, group = case.impl, case.ctx.group
    with torch.no_grad(), case.phases.at(Phase.STEP):
        for layer in layers:
            rows = layer.setup.master_slice(layer.masters[point]).to(layer.weight.spec.torch_dtype)
            impl.requantize_shard(local_shard(layer.module), rows, group)
        impl.after_step(module, group)


def _quantizer_diffs(layers: list[Layer], goldens: list[Golden]) -> tuple[BufferDiff, ...] | None:
    """Its own quantizer against the reference formats, for every weight (None: no quantizer of its own)."""
    if all(golden.quantizer_diffs is None for golden in goldens):
        return None
    return tuple(replace(d, name=f"{layer.weight.name}.{d.name}")
                 for layer, golden in zip(layers, goldens) for d in golden.quantizer_diffs or ())
