"""Judging a gathered weight where a forward receives it: FSDP2's pre-forward unshard gathers the
weight for the forward (through `out=` once it was gathered before), so the weight a forward uses
is only seen inside that forward. `judged_in_forward` hands it to a judge there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from qgather.model.phases import Phase, PhaseTracker
from qgather.model.records import Stage


@contextlib.contextmanager
def judged_in_forward(modules: Sequence[torch.nn.Module], judge: Callable[[torch.nn.Module], Stage],
                      phases: PhaseTracker, stages: list[Stage], compiled: bool = False) -> Iterator[None]:
    """While active, the forward of each of `modules` first hands the module, its weight as FSDP2's
    pre-forward unshard left it, to `judge`; the stages are appended to `stages`, in call order.

    The judge is a forward pre-hook registered after FSDP2's own (which FSDP2 prepends), so it runs
    after the unshard and before the forward reads the weight. `compiled`: the forward runs under
    torch.compile, and the judge is kept out of the graph (Dynamo runs it eagerly, as it runs FSDP2's
    hooks): the weight it judges is the graph's input. Enter it inside the forward's phase: the
    forward resumes in that phase after each judge."""
    entered = phases.current  # the forward's phase, which the hooks of FSDP2's unshard moved on from

    def hook(module: torch.nn.Module, args: tuple) -> None:
        with phases.at(Phase.INSPECTION):
            stages.append(judge(module))
        phases.current = entered

    # torch._dynamo is loaded lazily by torch: only a compiled forward pays its import
    run = torch._dynamo.disable(hook) if compiled else hook
    handles = [module.register_forward_pre_hook(run) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
