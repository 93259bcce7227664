"""The block scenario on the rank pool: every parameter of a transformer-like block in ONE `fully_shard`
group (qgather.model.block: three quantized weights of different shapes and regimes, plain
high-precision parameters between them), as real training shards a block; under `nested` the block
sits inside a model root with a parameter of its own (fully_shard(block), then fully_shard(root)),
else the block is the root. FSDP2 then gathers the whole group in one collective: every
pre-all-gather hook of the group runs, then one foreach copy-in into one flat buffer (uint8 as soon
as two all-gather inputs differ in dtype), one all-gather, one split-with-sizes copy-out and every
post-all-gather hook. State a hook keeps per class or per format instead of per parameter, offsets
into the flat buffer, a post-hook that assumes it is the group's only quantized parameter: none of
it shows in a group of one weight (the gather and layers scenarios).

Each quantized weight is first sharded alone (a probe of its own `fully_shard`), where a refusal
shows: a weight every rank refuses with the implementation's declared rejection is left out of the
block (REJECTED only if the policy accepts it and everything else is EXACT, as in the layers
scenario). A refusal only the group's pre-all-gather pass raises (a hook that checks alignment
itself) refuses the whole block, as it would a real model's: REJECTED where the policy accepts it,
without the other weights judged (the layers scenario, one group per weight, judges them). Then the
block's first unshard, alone: every parameter judged against its own golden
(quantized: bytes, values, layer output; plain: bit for bit against its master in the dtype the
mixed-precision policy asks for), and the group's one collective against the sum of what each
parameter may move (DEGRADED above it). Then, before the first step and after each of STEPS
optimizer steps (SGD on the full masters, each shard re-quantized or copied from its rows): the
model's forward without autograd, as the one-device twin's (each parameter judged where its module
receives it), the outputs and loss against the same model on one device, the backward's unshard
of the block from whatever the forward left, judged again, and the reshard. Under `compile` the
forward is `torch.compile(model)`'s.

Each quantized layer is the implementation's `make_block_layer` (the library's own layer, built
unsharded, e.g. TE's te.Linear on meta; materialized by `materialize_block_layer` once the block is
sharded, e.g. TE's reset_parameters), else the harness's (make_module or make_param). An adapter
with neither (only its own make_sharded_module) is SKIPPED by Implementation.skip_reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import fully_shard

from qgather.check.golden import Golden
from qgather.check.inspection import Inspector
from qgather.check.wire import WireLog, record_wire, summarize_wire
from qgather.errors import HarnessFault
from qgather.formats import FORMATS
from qgather.instruments.compare import compare_values
from qgather.instruments.digest import digest
from qgather.instruments.patches import hooks_moving_phase
from qgather.model.block import BlockParams, PlainParam, block_params
from qgather.model.case import CaseSpec, ShardLayout
from qgather.model.layers import LayerWeight
from qgather.model.phases import Phase, PhaseTracker
from qgather.model.records import BufferDiff, DiffProblem, RankResult, Stage, WireSummary
from qgather.runtime.rank import CaseContext
from qgather.scenarios import fsdp_setup
from qgather.scenarios.compiled import CaseForward
from qgather.scenarios.context import RankCase
from qgather.scenarios.judging import judged_in_forward
from qgather.scenarios.layers import (
    LEARNING_RATE,
    STEPS,
    Layer,
    _declared_refusal,
    _flat,
    _masters,
    _noted,
    _quantizer_diffs,
    _refusal_stage,
    _refusing_ranks,
)
from qgather.scenarios.module import harness_module, local_shard

PLAIN = ("norm", "bias")  # the block's plain parts (a nested model's root holds its scale)



class Scale(torch.nn.Module):
    """A plain parameter that scales its input elementwise (a norm's weight)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Shift(Scale):
    """A plain parameter added to its input (a bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class Block(torch.nn.Module):
    """The block: its parts in the group's order (first, norm, aligned, bias, other, experts; a quantized
    weight left out is absent). The forward scales its input by the norm, feeds it to every quantized
    layer and adds the bias to the aligned layer's output; it returns every output, in order."""

    def __init__(self, parts: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleDict(parts)

    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        n = self.parts["norm"](h)
        outputs = []
        for name, part in self.parts.items():
            if name not in PLAIN:
                y = part(n)
                outputs.append(self.parts["bias"](y) if name == "aligned" else y)
        return outputs


class Model(torch.nn.Module):
    """The model root of a `nested` case: its own plain parameter (the input's scale), then the block."""

    def __init__(self, scale: Scale, block: Block) -> None:
        super().__init__()
        self.scale, self.block = scale, block

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.block(self.scale(x))


@dataclass
class Plain:
    """One plain parameter on this rank: its module and its full float32 masters at every point."""

    param: PlainParam
    module: Scale
    masters: list[torch.Tensor]


def run_block(ctx: CaseContext, spec: CaseSpec, phases: PhaseTracker, checkpoint: str | None = None) -> RankResult:
    """One block case on this rank, end to end."""
    if checkpoint is not None:
        raise HarnessFault(f"case {spec.id}: the block scenario loads no checkpoint")
    case = RankCase.prepare(ctx, spec, phases, checkpoint)
    params = block_params(spec)
    layers, stages, notes = _quantized_layers(case, params)
    if not layers:
        if not stages:  # nothing refused and nothing built: a verdict would rest on no judged stage
            raise HarnessFault(f"case {spec.id}: the implementation holds none of the block's weights "
                               f"({'; '.join(notes)})")
        return RankResult(ctx.rank, tuple(stages))
    plains = {p.name: _plain(case, p) for p in params.plain}
    parts = {layer.weight.name: layer.module for layer in layers}
    ordered = {name: parts.get(name) for name in ("first", "norm", "aligned", "bias", "other", "experts")}
    ordered.update(norm=plains["norm"].module, bias=plains["bias"].module)
    block = Block({name: module for name, module in ordered.items() if module is not None})
    model = Model(plains["scale"].module, block) if spec.config.nested else block
    with phases.at(Phase.SHARD):
        fully_shard(block, **case.setup.kwargs)
        if model is not block:
            fully_shard(model, **case.setup.kwargs)
    with phases.at(Phase.BUILD):
        for layer in layers:
            if layer.own_route:
                case.impl.materialize_block_layer(layer.module)
    run = _BlockRun(case, model, layers, list(plains.values()))
    goldens = [layer.golden(0) for layer in layers]
    first, wire = run.first_gather(goldens)
    if notes:
        first[0] = _noted(first[0], "; ".join(notes))
    stages += first
    twin = _twin_outputs(case, layers, plains)
    if isinstance(twin, str):
        stages[-1] = _noted(stages[-1], twin)
    run.twin = None if isinstance(twin, str) else twin
    for point in range(STEPS + 1):
        run.requantize(point)
        stages += run.iteration(point, goldens if point == 0 else [layer.golden(point) for layer in layers])
    return RankResult(ctx.rank, tuple(stages), None, _quantizer_diffs(layers, goldens), wires=(wire,))


# ------------------------------------------------------------------ building
def _quantized_layers(case: RankCase, params: BlockParams) -> tuple[list[Layer], list[Stage], list[str]]:
    """The block's quantized layers (unsharded: the block's fully_shard shards them), the stages of
    the weights left out (refused on every rank by the probe of their own fully_shard) and the notes
    of those the implementation does not hold (its skip_reason). The ranks agree on every probe's
    refusals in one collective, after the last probe."""
    built: list[tuple[LayerWeight, list[torch.Tensor], fsdp_setup.Setup, torch.nn.Module | None]] = []
    refusals: list[Exception | None] = []  # per harness-built weight, in order: its probe's refusal
    notes: list[str] = []
    for weight in params.quantized:
        skip = case.impl.skip_reason(weight.spec, case.ctx.device)
        if skip:
            notes.append(f"{weight.title} left out: {skip}")
            continue
        masters = _masters(weight, case.ctx.device)
        setup = fsdp_setup.prepare(case.ctx, weight.spec)
        with case.phases.at(Phase.BUILD):
            module = case.impl.make_block_layer(case.ctx, weight.spec, masters[0], setup)
        if module is None:  # the library's own layer refuses where it is materialized: no probe of it
            refusals.append(_probe(case, weight, masters[0], setup))
        built.append((weight, masters, setup, module))
    refusing = iter(_refusing_ranks(case.ctx, [r is not None for r in refusals]) if refusals else ())
    refusal = iter(refusals)
    layers: list[Layer] = []
    stages: list[Stage] = []
    for weight, masters, setup, module in built:
        own_route = module is not None
        if not own_route:
            refused = _refusal_stage(case, weight, next(refusal), next(refusing))
            if refused is not None:
                stages.append(refused)
                continue
            with case.phases.at(Phase.BUILD):
                module = harness_module(case.impl, weight.spec.fmt, masters[0].to(weight.spec.torch_dtype))
        inspector = Inspector(weight.spec, case.impl, FORMATS[weight.spec.fmt], case.x, setup.shards)
        layers.append(Layer(weight, module, setup, inspector, masters, own_route=own_route))
    return layers, stages, notes


def _probe(case: RankCase, weight: LayerWeight, master: torch.Tensor, setup: fsdp_setup.Setup) -> Exception | None:
    """The weight built and sharded alone (a throwaway module): this rank's declared refusal of it, None
    when it shards (anything else is raised)."""
    try:
        with case.phases.at(Phase.BUILD):
            probe = harness_module(case.impl, weight.spec.fmt, master.to(weight.spec.torch_dtype))
            with case.phases.at(Phase.SHARD):
                fully_shard(probe, **setup.kwargs)
    except Exception as exc:  # noqa: BLE001 - a declared refusal is recorded; anything else is raised
        return _declared_refusal(case, exc)
    return None


def _plain(case: RankCase, param: PlainParam) -> Plain:
    """A plain parameter's module (its full value, unsharded) and its masters at every point."""
    device = case.ctx.device
    generator = torch.Generator().manual_seed(param.seed)
    master = torch.nn.Parameter((torch.randn(param.length, generator=generator) * 0.5 + 1.0).to(device))
    optimizer = torch.optim.SGD([master], lr=LEARNING_RATE, momentum=0.9)
    masters = [master.detach().clone()]
    for step in range(1, STEPS + 1):
        grad = torch.randn(param.length, generator=torch.Generator().manual_seed(param.seed * 1000 + step))
        master.grad = grad.to(device)  # drawn on the CPU (the same numbers on every device), then moved
        optimizer.step()
        masters.append(master.detach().clone())
    kind = Shift if param.name == "bias" else Scale
    return Plain(param, kind(masters[0].to(case.spec.torch_dtype)), masters)


# ------------------------------------------------------------------ the one-device model
def _twin_outputs(case: RankCase, layers: list[Layer], plains: dict[str, Plain]) -> list[torch.Tensor] | str:
    """What the same model computes on one device holding the full parameters, at every point: the
    loss and the outputs, flattened; or why there is nothing to compare."""
    spec, impl = case.spec, case.impl
    if case.setup.param_dtype != spec.torch_dtype:
        return (f"outputs not compared with a one-device model: it has no mixed-precision policy to compute "
                f"in {case.setup.param_dtype} (each parameter's gather and each layer's output are judged)")
    dtype = spec.torch_dtype
    points = []
    for point in range(STEPS + 1):
        value = {name: plain.masters[point].to(dtype) for name, plain in plains.items()}
        h = case.x.to(dtype) * value["scale"] if "scale" in value else case.x.to(dtype)
        n = h * value["norm"]
        outputs = []
        for layer in layers:
            weight = layer.masters[point].to(dtype)
            with torch.no_grad(), impl.forward_context(spec):
                if layer.own_route:
                    y = impl.single_device_output(layer.weight.spec, weight, n)
                    if y is None:
                        return (f"outputs not compared with a one-device model: {impl.name} builds "
                                f"{layer.weight.title} itself and has no single_device_output")
                    # the sharded layer hands the bias its output in the activations' dtype; a twin may
                    # widen it (TE's returns float32), and a bias added in float32 rounds differently
                    y = y.to(n.dtype)
                else:
                    y = harness_module(impl, layer.weight.spec.fmt, weight)(n)
            outputs.append(y + value["bias"] if layer.weight.name == "aligned" else y)
        points.append(_flat(outputs))
    return points


# ------------------------------------------------------------------ the sharded model
class _BlockRun:
    """The sharded model on this rank: its first gather, its iterations and its optimizer steps."""

    def __init__(self, case: RankCase, model: Model | Block, layers: list[Layer], plains: list[Plain]) -> None:
        self.case, self.model, self.layers, self.plains = case, model, layers, plains
        self.block = model.block if isinstance(model, Model) else model
        self._in_root = [p.module for p in plains if p.param.in_root]  # gathered by the root's group only
        self.param_types = tuple(dict.fromkeys(type(local_shard(layer.module)) for layer in layers))
        self.twin: list[torch.Tensor] | None = None
        self.forward = CaseForward(case, model)

    # the stages of every parameter -----------------------------------------------------------
    def _judge(self, module: torch.nn.Module, goldens: dict[int, Golden], point: int, what: str) -> Stage:
        layer = next((layer for layer in self.layers if layer.module is module), None)
        if layer is not None:
            return layer.inspector.judge(module.weight, goldens[id(module)], f"{what}: {layer.weight.title}",
                                         layer.setup.param_dtype)
        plain = next(plain for plain in self.plains if plain.module is module)
        return _judge_plain(plain, module.weight, point, self.case.setup.param_dtype, self.case.spec,
                            f"{what}: {plain.param.title}")

    def _judged_modules(self) -> list[torch.nn.Module]:
        """Every parameter's module: the block's, and under `nested` the root's scale (judged in the
        forward only: the block's unshard does not gather it)."""
        return [layer.module for layer in self.layers] + [p.module for p in self.plains]


    def _judge_all(self, goldens: dict[int, Golden], point: int, what: str) -> list[Stage]:
        with self.case.phases.at(Phase.INSPECTION):
            return [self._judge(module, goldens, point, what) for module in self._judged_modules()
                    if module not in self._in_root]

    def first_gather(self, goldens: list[Golden]) -> tuple[list[Stage], WireSummary]:
        """The block's first unshard alone (one collective for the group): every parameter judged, and
        the group's wire summary."""
        case, phases, impl = self.case, self.case.phases, self.case.impl
        by_module = self._by_module(goldens)
        with phases.at(Phase.SHARD), hooks_moving_phase(phases, self.param_types), \
                impl.gather_context(case.ctx.group), record_wire(self.param_types) as wire:
            self.block.unshard()
        stages = self._judge_all(by_module, 0, "the block's first unshard (one all-gather for the group)")
        self.block.reshard()
        return stages, self._wire_summary(wire, goldens)

    def _by_module(self, goldens: list[Golden]) -> dict[int, Golden]:
        return {id(layer.module): golden for layer, golden in zip(self.layers, goldens)}

    def _wire_summary(self, wire: WireLog, goldens: list[Golden]) -> WireSummary:
        """The group's one collective against the sum of what each of its parameters may move: each
        quantized weight its implementation's allowance, each plain one its padded shard in the
        dtype FSDP2 gathers it in."""
        case = self.case
        parts = [summarize_wire(WireLog(), layer.inspector.fmt,
                                layer.masters[0].to(device="meta", dtype=case.spec.torch_dtype),
                                layer.setup.shards, golden, case.impl, label=layer.weight.title)
                 for layer, golden in zip(self.layers, goldens)]
        size = case.setup.shards.world_size
        plain_bytes = sum(ShardLayout(p.param.length, size, 1).chunk * case.setup.param_dtype.itemsize
                          for p in self.plains if not p.param.in_root)
        packed = [p.packed_bytes for p in parts]
        allowed = [p.allowed_bytes for p in parts]
        known = all(v is not None for v in (*packed, *allowed))
        return WireSummary(collective_bytes=wire.collective_bytes, collectives=wire.collectives,
                           hook_calls=wire.hook_calls, hook_outputs=tuple(wire.hook_outputs),
                           high_precision_elements=wire.high_precision_elements(),
                           shard_numel=sum(p.shard_numel for p in parts),
                           param_itemsize=case.spec.torch_dtype.itemsize,
                           packed_bytes=sum(packed) + plain_bytes if known else None,
                           wire_mode="+".join(dict.fromkeys(p.wire_mode for p in parts)) + " + plain",
                           allowed_bytes=sum(allowed) + plain_bytes if known else None,
                           label=f"the block's group: {len(parts)} quantized and {len(self.plains) - 1} plain "
                                 "parameters")

    # one iteration -----------------------------------------------------------------------------
    def iteration(self, point: int, goldens: list[Golden]) -> list[Stage]:
        """The stages of one iteration at `point` (0: before step 1, k: after step k)."""
        case, phases, impl = self.case, self.case.phases, self.case.impl
        when = "before step 1" if point == 0 else f"after step {point}"
        by_module = self._by_module(goldens)
        stages: list[Stage] = []
        judged = self._judged_modules()  # the root's scale too: the root's pre-forward gathers it
        # Without autograd, as the one-device twin runs: no backward follows, and a grad-enabled exit of
        # TE's te.autocast updates DelayedScaling's scales (quantization.py autocast_exit), which would
        # re-quantize the next point's shards and inputs at scales neither the golden nor a twin holds.
        with phases.at(Phase.FORWARD), torch.no_grad(), hooks_moving_phase(phases, self.param_types), \
                impl.gather_context(case.ctx.group), impl.forward_context(case.spec), \
                judged_in_forward(judged, lambda m: self._judge(m, by_module, point, f"{when}, the forward"),
                                  phases, stages, compiled=self.forward.compiled):
            outputs = self.forward(case.x.to(case.spec.torch_dtype))
        stages += self._outputs_stage(when, point, outputs)
        with phases.at(Phase.STEP), hooks_moving_phase(phases, self.param_types), impl.gather_context(case.ctx.group):
            self.block.unshard()
        stages += self._judge_all(by_module, point, f"{when}, the backward's unshard of the block")
        self.block.reshard()
        self.model.reshard()
        return stages

    def _outputs_stage(self, when: str, point: int, outputs: list[torch.Tensor]) -> list[Stage]:
        """The outputs and loss against the one-device module's (nothing when there is none to compare
        with), or the error of a compiled forward that ran no compiled graph."""
        label = f"{when}: the model's outputs and loss against the same model on one device"
        expected = self.twin[point] if self.twin is not None else None
        return self.forward.outputs_stage(label, "model", _flat(outputs), expected)

    def requantize(self, point: int) -> None:
        """Every shard re-quantized (or, plain, copied) from its rows of the masters at `point` (0:
        unchanged, before any gather), then the implementation's after-step hook on the model."""
        case = self.case
        setup = case.setup
        with torch.no_grad(), case.phases.at(Phase.STEP):
            for layer in self.layers:
                rows = layer.setup.master_slice(layer.masters[point]).to(layer.weight.spec.torch_dtype)
                case.impl.requantize_shard(local_shard(layer.module), rows, case.ctx.group)
            for plain in self.plains:
                start, end = ShardLayout(plain.param.length, setup.shards.world_size, 1).dim0_range(setup.shard_rank)
                local_shard(plain.module).copy_(plain.masters[point][start:end])
            case.impl.after_step(self.model, case.ctx.group)


def _judge_plain(plain: Plain, weight: torch.Tensor, point: int, dtype: torch.dtype, spec: CaseSpec,
                 label: str) -> Stage:
    """A gathered plain parameter bit for bit against its master at `point`, in the dtype the
    mixed-precision policy asks for (FSDP2 casts it in the copy-in)."""
    want = plain.masters[point].to(spec.torch_dtype).to(dtype)
    got = weight.detach()
    problem = "" if got.dtype == dtype else f"the unsharded parameter is {got.dtype}, the policy asks for {dtype}"
    values = compare_values(got, want)
    diffs = () if values.equal else (BufferDiff("values", DiffProblem.BITS, max(values.n_diff, 0), want.numel()),)
    # a plain parameter has no layer of its own: its values are its output (what the module computes with)
    return Stage(label, digest=digest({"values": got}, {}), buffer_diffs=diffs, dequantized=values,
                 output=values, output_digest=digest({"values": got}, {}), dtype_problem=problem)
