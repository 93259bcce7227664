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
eager never takes.

Backend: `aot_eager` (QGATHER_COMPILE_BACKEND to choose another, e.g. `inductor`). AOTAutograd
traces the subclass exactly as inductor's front end does; inductor adds codegen, which needs a C++
compiler on CPU and took 20 s for the first fp8_tensor graph on the 2-core CI machine (4 s for the
next), against 2 s and 0.2-0.7 s for aot_eager, and writes a cache dir that outlives the runner.
The stage's label names the backend that ran. A compile that captured no graph tested nothing:
it is reported as an error of the forward, not as a pass.
"""

from __future__ import annotations

import os

import torch

from qgather.check.golden import Golden
from qgather.instruments.compare import compare_values, digest
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
    """The chosen backend (`name`), counting the graphs Dynamo hands it."""

    def __init__(self, name: str) -> None:
        # torch._dynamo is one of torch's lazily loaded submodules: only a compile case pays its import
        # (about 0.5 s of CPU), not every runner process that imports the scenarios to send them.
        self.name = name
        self.backend = torch._dynamo.lookup_backend(name)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


NO_GRAPH = "torch.compile captured no graph (Dynamo ran the whole forward eagerly): nothing compiled"


class CaseForward:
    """A whole module's forward as a case runs it (the layers and block scenarios): eager, or under
    `compile` torch.compile with a backend that counts its graphs. `close` clears what Dynamo cached."""

    def __init__(self, case: RankCase, module: torch.nn.Module) -> None:
        self.counting: CountingBackend | None = None
        self.call = module
        if case.spec.config.compile:
            # A warm rank runs many cases through the same code: Dynamo's caches start empty for each.
            torch._dynamo.reset()
            self.counting = CountingBackend(backend_name())
            self.call = torch.compile(module, backend=self.counting)

    @property
    def compiled(self) -> bool:
        return self.counting is not None

    def close(self) -> None:
        if self.counting is not None:
            torch._dynamo.reset()

    def outputs_stage(self, label: str, what: str, got: torch.Tensor, expected: torch.Tensor | None) -> list[Stage]:
        """The flattened outputs `got` against the one-device `expected` (nothing when there is none to
        compare with), or the error of a compile that captured no graph; `what` names the module."""
        if self.counting is not None and self.counting.graphs == 0:
            return [Stage(label, forward_error=NO_GRAPH)]
        if expected is None:
            return []
        note = f"{what} forward: torch.compile backend {self.counting.name}, FSDP2 hooks eager" if self.counting else ""
        return [Stage(label, output=compare_values(got, expected.to(got.device)),
                      output_digest=digest({"output": got}, {}), note=note)]


def compiled_stages(case: RankCase, module: torch.nn.Module, golden: Golden, when: str = "") -> list[Stage]:
    """The module's eager forward, then its compiled forward, each on the case's input in the masters'
    dtype after a reshard (FSDP2's own unshard gathers the weight for it): each gathered weight judged
    against `golden` where the forward receives it, then the compiled output compared bit for bit with
    the eager one. `when` starts the stages' labels (e.g. "after step 1"). Errors of the compiled
    forward are recorded on the last stage, not raised. The module is left unsharded (a root's
    forward keeps its weight): the caller reshards."""
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
    # A warm rank runs many cases through the same forward code: without a reset, Dynamo's cache
    # limit would silently turn later cases' compiles into eager runs.
    torch._dynamo.reset()
    counting = CountingBackend(name)
    try:
        with phases.at(Phase.COMPILE), impl.gather_context(group), impl.forward_context(spec), \
                judged_in_forward([module], judge("the compiled forward's unshard"), phases, stages, compiled=True):
            compiled = torch.compile(module, backend=counting)(x)
    except Exception as exc:  # noqa: BLE001 - the compiled forward's error is the evidence
        return [*stages, Stage(label, forward_error=f"{type(exc).__name__} under torch.compile: "
                                                    f"{(str(exc).strip().splitlines() or [''])[0][:300]}")]
    finally:
        torch._dynamo.reset()
    if counting.graphs == 0:
        return [*stages, Stage(label, forward_error=NO_GRAPH)]
    return [*stages, Stage(label, output=_compare(compiled, eager), output_digest=digest({"output": compiled}, {}),
                           note=f"compiled forward: torch.compile backend {name}, {counting.graphs} graph(s), "
                                "FSDP2 hooks eager")]


def _compare(compiled: torch.Tensor, eager: torch.Tensor) -> Comparison:
    if compiled.dtype != eager.dtype:
        return Comparison(False, -1, float("inf"), detail=f"dtype {compiled.dtype} (eager: {eager.dtype})")
    return compare_values(compiled, eager)
