"""torch.compile around the gathered weight (`compile` in a case id): the module compiled as
training code compiles it (`torch.compile(module)`, FSDP2's unshard/reshard hooks staying eager:
Dynamo skips FSDP2's hooks), its output bit for bit against the same module's eager forward.

The module is the implementation's own: qgather's linear layer over the quantized weight for the
reference and the mutants, torchao's real `Float8Linear.forward` (float8 activation cast and
`torch._scaled_mm`, which has a CPU kernel in torch 2.11+) for torchao, with its precomputed scales
under `torchao:precompute`. Both runs go through FSDP2's unshard, so the compiled graph takes the
gathered subclass as an input: Dynamo and AOTAutograd flatten it to its inner tensors and rebuild
it with `__tensor_unflatten__`, the path eager never takes.

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

from qgather.check.compare import compare_values, digest
from qgather.model.phases import Phase
from qgather.model.records import Comparison, Stage
from qgather.scenarios.context import RankCase

BACKEND_ENV = "QGATHER_COMPILE_BACKEND"
DEFAULT_BACKEND = "aot_eager"


def backend_name() -> str:
    """The torch.compile backend the compiled forward uses (QGATHER_COMPILE_BACKEND, else aot_eager)."""
    return os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND


class _CountingBackend:
    """The chosen backend, counting the graphs Dynamo hands it."""

    def __init__(self, name: str) -> None:
        # torch._dynamo is one of torch's lazily loaded submodules: only a compile case pays its import
        # (about 0.5 s of CPU), not every runner process that imports the scenarios to send them.
        self.backend = torch._dynamo.lookup_backend(name)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


def compiled_stage(case: RankCase, module: torch.nn.Module) -> Stage:
    """The module's eager forward, then its compiled forward (each with FSDP2's own unshard and
    reshard around it), on the case's input in the masters' dtype, compared bit for bit. Errors
    are recorded on the stage, not raised."""
    impl, spec, group, phases = case.impl, case.spec, case.ctx.group, case.phases
    x = case.x.to(spec.torch_dtype)
    name = backend_name()
    label = f"compiled forward (torch.compile, backend {name}) against the eager forward"
    with phases.at(Phase.FORWARD), impl.gather_context(group), impl.forward_context(spec):
        eager = module(x)
    # A warm rank runs many cases through the same forward code: without a reset, Dynamo's cache
    # limit would silently turn later cases' compiles into eager runs.
    torch._dynamo.reset()
    counting = _CountingBackend(name)
    try:
        with phases.at(Phase.COMPILE), impl.gather_context(group), impl.forward_context(spec):
            compiled = torch.compile(module, backend=counting)(x)
    except Exception as exc:  # noqa: BLE001 - the compiled forward's error is the evidence
        return Stage(label, forward_error=f"{type(exc).__name__} under torch.compile: "
                                          f"{(str(exc).strip().splitlines() or [''])[0][:300]}")
    finally:
        torch._dynamo.reset()
    if counting.graphs == 0:
        return Stage(label, forward_error="torch.compile captured no graph (Dynamo ran the whole forward eagerly): "
                                          "nothing compiled")
    return Stage(label, output=_compare(compiled, eager), output_digest=digest({"output": compiled}, {}),
                 note=f"compiled forward: torch.compile backend {name}, {counting.graphs} graph(s), FSDP2 hooks eager")


def _compare(compiled: torch.Tensor, eager: torch.Tensor) -> Comparison:
    if compiled.dtype != eager.dtype:
        return Comparison(False, -1, float("inf"), detail=f"dtype {compiled.dtype} (eager: {eager.dtype})")
    return compare_values(compiled, eager)
