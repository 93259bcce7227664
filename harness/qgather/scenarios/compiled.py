"""torch.compile around the gathered weight (`compile` in a case id): the module compiled as
training code compiles it (`torch.compile(module)`, FSDP2's unshard/reshard hooks staying eager:
Dynamo skips FSDP2's hooks), its output bit for bit against the same module's eager forward.

Each forward runs after a reshard, so FSDP2's own pre-forward unshard gathers the weight for it:
once the module has been gathered, through the `out=` path of the post-all-gather hook (a root
module then keeps the weight after its forward). Each of those gathered weights is judged against
the golden where the forward receives it (qgather.scenarios.judging), bytes and values, like the
first unshard: comparing the compiled output with the eager one alone would pass a weight that both
forwards received equally wrong.

The module is the implementation's own: qgather's linear layer over the quantized weight for the
reference and the mutants, torchao's real `Float8Linear.forward` (float8 activation cast and
`torch._scaled_mm`, which has a CPU kernel in torch 2.11+) for torchao, with its precomputed scales
under `torchao:precompute`. The compiled graph takes the gathered subclass as an input: Dynamo and
AOTAutograd flatten it to its inner tensors and rebuild it with `__tensor_unflatten__`, the path
eager never takes. (The reference's dequantization is one custom op in that graph,
qgather.impls.reference.traced: tracing it op by op was about half of a compiled forward's time.)

Backend: `aot_eager` (QGATHER_COMPILE_BACKEND to choose another, e.g. `inductor`). AOTAutograd
traces the subclass exactly as inductor's front end does; inductor adds codegen, which needs a C++
compiler on CPU and took 20 s for the first fp8_tensor graph on the 2-core CI machine (4 s for the
next), against 2 s and 0.2-0.7 s for aot_eager, and writes a cache dir that outlives the runner.
The stage's label names the backend that ran.

A case compiles its module once and calls the compiled module at every point it runs a forward
(after the first gather, after each optimizer step), as a training loop calls its compiled model
every step: Dynamo recompiles only where a guard fails, and a step's forward otherwise runs the
graph traced for the first (with the step's re-quantized inner tensors as its inputs). What Dynamo
compiled stays warm on the rank for its next compiled cases (`WarmCompiles`): a case whose module and
gathered weight pass an earlier case's guards runs that graph without tracing it again. A forward
that ran no compiled graph tested nothing (a compile that captured none, or Dynamo running a call
eagerly): it is reported as an error of the forward, not as a pass.
"""

from __future__ import annotations

import os

import torch

from qgather.check.golden import Golden
from qgather.instruments.compare import compare_values
from qgather.instruments.digest import digest
from qgather.instruments.patches import guard_latency_unmeasured
from qgather.model.phases import Phase
from qgather.model.records import Comparison, Stage
from qgather.scenarios.context import RankCase
from qgather.scenarios.judging import judged_in_forward

BACKEND_ENV = "QGATHER_COMPILE_BACKEND"
DEFAULT_BACKEND = "aot_eager"


def backend_name() -> str:
    """The torch.compile backend the compiled forward uses (QGATHER_COMPILE_BACKEND, else aot_eager)."""
    return os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND


class CountingBackend:
    """The chosen backend (`name`), counting the graphs Dynamo hands it and the calls of what it compiled."""

    def __init__(self, name: str) -> None:
        # torch._dynamo is one of torch's lazily loaded submodules: only a compile case pays its import
        # (about 0.5 s of CPU), not every runner process that imports the scenarios to send them.
        self.name = name
        self.backend = torch._dynamo.lookup_backend(name)
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        compiled = self.backend(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo calls a boxed graph with one list
        return run


class WarmCompiles:
    """What Dynamo compiled, kept warm across the cases of one rank process: one counting backend per
    backend name, so that a later case whose module and gathered weight pass an earlier graph's guards
    (same module structure, subclass, shapes and dtypes: one graph per shape class) runs that graph
    without tracing it again; Dynamo's guards decide, as they do between a training loop's steps.

    Dynamo allows a code object `recompile_limit` cache entries (8) before it runs it eagerly, which a
    case would report as "ran no compiled graph"; a warm rank sees many shape classes, so the limit is
    raised to RECOMPILE_LIMIT and the caches are reset every RESET_EVERY cases (a case compiles a few
    entries at most: its first forward, a step's new guards), and whenever the backend changes.

    Automatic dynamic shapes are off: a guard that fails on a shape recompiles a static graph, as a
    case's first compile does, so that what a case compiles does not depend on the cases its rank ran
    before (a dynamic recompile, which Dynamo would otherwise make after a second shape, traces a
    different graph and costs more)."""

    RECOMPILE_LIMIT = 64
    RESET_EVERY = 16

    def __init__(self) -> None:
        self.counting: CountingBackend | None = None
        self.cases = 0

    def backend(self, name: str) -> CountingBackend:
        """The backend a new compiled case uses, after a reset where one is due."""
        if self.counting is None or self.counting.name != name or self.cases >= self.RESET_EVERY:
            torch._dynamo.reset()
            torch._dynamo.config.recompile_limit = self.RECOMPILE_LIMIT
            torch._dynamo.config.automatic_dynamic_shapes = False
            self.counting, self.cases = CountingBackend(name), 0
        self.cases += 1
        return self.counting


#: this rank process's warm compiles (a rank runs one case at a time; the pool keeps it for the next)
WARM = WarmCompiles()


NO_GRAPH = "torch.compile captured no graph (Dynamo ran the whole forward eagerly): nothing compiled"
NO_GRAPH_RAN = ("this forward ran none of the compiled graphs (Dynamo ran it eagerly, e.g. past its "
                "recompile limit): nothing compiled was tested")


class CaseForward:
    """A whole module's forward as a case runs it: eager, or under `compile` torch.compile with a
    backend that counts its graphs and their calls (the rank's warm one, `WARM`), compiled once for the
    case and called at every point of it (as a training loop calls its compiled model every step:
    Dynamo recompiles only where a guard fails). Each call records whether it ran a compiled graph."""

    def __init__(self, case: RankCase, module: torch.nn.Module) -> None:
        self.counting: CountingBackend | None = None
        self.module = module
        self.ran_graph = False
        self.graphs_before = 0
        if case.spec.config.compile:
            self.counting = WARM.backend(backend_name())
            self.graphs_before = self.counting.graphs
            self.module = torch.compile(module, backend=self.counting)

    @property
    def compiled(self) -> bool:
        return self.counting is not None

    def __call__(self, x: torch.Tensor):
        if self.counting is None:
            return self.module(x)
        calls = self.counting.calls
        with guard_latency_unmeasured():
            out = self.module(x)
        self.ran_graph = self.counting is not None and self.counting.calls > calls
        return out

    def problem(self) -> str | None:
        """Why the last call tested nothing compiled (None when it ran a compiled graph, or is eager)."""
        if self.counting is None or self.ran_graph:
            return None
        return NO_GRAPH if self.counting.graphs == 0 else NO_GRAPH_RAN

    @property
    def graphs(self) -> int:
        """The graphs Dynamo compiled for this case (the others it ran came warm from earlier cases)."""
        return self.counting.graphs - self.graphs_before if self.counting is not None else 0

    def outputs_stage(self, label: str, what: str, got: torch.Tensor, expected: torch.Tensor | None) -> list[Stage]:
        """The flattened outputs `got` against the one-device `expected` (nothing when there is none to
        compare with), or the error of a compiled call that ran no compiled graph; `what` names the module."""
        problem = self.problem()
        if problem:
            return [Stage(label, forward_error=problem)]
        if expected is None:
            return []
        note = f"{what} forward: torch.compile backend {self.counting.name}, FSDP2 hooks eager" if self.counting else ""
        return [Stage(label, output=compare_values(got, expected.to(got.device)),
                      output_digest=digest({"output": got}, {}), note=note)]


def compiled_stages(case: RankCase, module: torch.nn.Module, golden: Golden, compiled: CaseForward,
                    when: str = "") -> list[Stage]:
    """The module's eager forward, then its compiled forward (`compiled`, the case's one compile of
    `module`), each on the case's input in the masters' dtype after a reshard (FSDP2's own unshard
    gathers the weight for it): each gathered weight judged against `golden` where the forward
    receives it, then the compiled output compared bit for bit with the eager one. `when` starts the
    stages' labels (e.g. "after step 1"). Errors of the compiled forward are recorded on the last
    stage, not raised. The module is left unsharded (a root's forward keeps its weight): the caller
    reshards."""
    impl, spec, group, phases = case.impl, case.spec, case.ctx.group, case.phases
    x = case.x.to(spec.torch_dtype)
    name = backend_name()
    label = f"{when + ': ' if when else ''}compiled forward (torch.compile, backend {name}) against the eager forward"

    def judge(what: str):
        return lambda m: case.inspector.judge(m.weight, golden, f"{when + ', ' if when else ''}torch.compile: {what}",
                                              case.setup.param_dtype)

    stages: list[Stage] = []
    module.reshard()
    with phases.at(Phase.FORWARD), judged_in_forward([module], judge("the eager forward's unshard"), phases, stages), \
            impl.gather_context(group), impl.forward_context(spec):
        eager = module(x)
    module.reshard()
    try:
        with phases.at(Phase.COMPILE), impl.gather_context(group), impl.forward_context(spec), \
                judged_in_forward([module], judge("the compiled forward's unshard"), phases, stages, compiled=True):
            out = compiled(x)
    except Exception as exc:  # noqa: BLE001 - the compiled forward's error is the evidence
        return [*stages, Stage(label, forward_error=f"{type(exc).__name__} under torch.compile: "
                                                    f"{(str(exc).strip().splitlines() or [''])[0][:300]}")]
    problem = compiled.problem()
    if problem:
        return [*stages, Stage(label, forward_error=problem)]
    return [*stages, Stage(label, output=_compare(out, eager), output_digest=digest({"output": out}, {}),
                           note=f"compiled forward: torch.compile backend {name}, {compiled.graphs} graph(s) "
                                "compiled for the case (others warm), FSDP2 hooks eager")]


def _compare(compiled: torch.Tensor, eager: torch.Tensor) -> Comparison:
    if compiled.dtype != eager.dtype:
        return Comparison(False, -1, float("inf"), detail=f"dtype {compiled.dtype} (eager: {eager.dtype})")
    return compare_values(compiled, eager)
