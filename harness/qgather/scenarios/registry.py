"""Which code runs each scenario: a scenario name (qgather.model.case.SCENARIOS) mapped to its runner
on a rank of the pool, or in one process; `run_on_rank` is what the runner sends to every rank.

The table is checked when this module is imported: every scenario the case model names has exactly
one runner, and no runner serves a name the case model does not know.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from qgather.errors import HarnessFault
from qgather.impls import get_impl
from qgather.instruments.device_clock import CudaClock
from qgather.model.case import SCENARIOS, CaseSpec
from qgather.model.phases import PhaseTracker
from qgather.model.records import RankResult
from qgather.runtime.rank import CaseContext
from qgather.scenarios.block import run_block
from qgather.scenarios.fsdp import run_fsdp
from qgather.scenarios.hooks import run_hooks
from qgather.scenarios.layers import run_layers
from qgather.scenarios.virtual import run_virtual

#: a scenario on one rank of the pool: (ctx, spec, phases, checkpoint directory or None) -> its result
RankRunner = Callable[[CaseContext, CaseSpec, PhaseTracker, str | None], RankResult]


def _run_model(ctx: CaseContext, spec: CaseSpec, phases: PhaseTracker, checkpoint: str | None = None) -> RankResult:
    """The model scenario: the library's own model, trained as its users train it (the adapter's run_model)."""
    return get_impl(spec.impl).run_model(ctx, spec, phases)


#: scenarios that run on every rank of a pool
ON_RANKS: dict[str, RankRunner] = {
    "gather": run_fsdp,
    "steps": run_fsdp,
    "reshard": run_fsdp,
    "hooks": run_hooks,
    "model": _run_model,
    "layers": run_layers,
    "block": run_block,
}
#: scenarios that emulate every rank in one process: spec -> one RankResult or exception per rank
IN_ONE_PROCESS: dict[str, Callable[[CaseSpec], list[RankResult | BaseException]]] = {
    "virtual": run_virtual,
}


def _check_covers(names: tuple[str, ...]) -> None:
    """Every scenario name has exactly one runner (raised at import: a scenario added to the case
    model without a runner, or a runner left for a removed one, is a harness fault)."""
    both = set(ON_RANKS) & set(IN_ONE_PROCESS)
    missing = set(names) - set(ON_RANKS) - set(IN_ONE_PROCESS)
    unknown = (set(ON_RANKS) | set(IN_ONE_PROCESS)) - set(names)
    if both or missing or unknown:
        raise HarnessFault(f"scenario registry out of step with qgather.model.case.SCENARIOS: runs on ranks and in "
                           f"one process {sorted(both)}, no runner {sorted(missing)}, unknown {sorted(unknown)}")


_check_covers(SCENARIOS)


def run_on_rank(ctx: CaseContext, spec: CaseSpec, checkpoint: str | None = None) -> RankResult:
    """Entry point on every rank of a pool: one case, end to end (`checkpoint`: the directory a
    `dcp-wsA` case loads, saved by qgather.engine.checkpoint). An exception leaving it carries the
    phase it was raised in (qgather.model.phases)."""
    runner = ON_RANKS.get(spec.scenario)
    if runner is None:
        where = "runs in one process, not on a rank pool" if spec.scenario in IN_ONE_PROCESS else "is unknown"
        raise HarnessFault(f"case {spec.id}: scenario {spec.scenario!r} {where}")
    phases = PhaseTracker(_device_clock(ctx.device), _device_memory(ctx.device))
    with phases.tagging():
        result = runner(ctx, spec, phases, checkpoint)
    if not isinstance(result, RankResult):
        return result
    seconds = phases.seconds()  # the last reading, of the memory mark too: before high_water()
    return replace(result, seconds=seconds, started=phases.started(), high_water=phases.high_water())


def _device_clock(device: torch.device) -> CudaClock | None:
    """How the step clock reads a device that runs its queued work asynchronously (CUDA)."""
    return CudaClock(device) if device.type == "cuda" else None


def _device_memory(device: torch.device) -> Callable[[], int] | None:
    """The device's high-water mark of allocated bytes, for the step clock to charge each rise to a step.
    Read from the allocator's nested statistics: torch.cuda.max_memory_allocated flattens all of them
    in Python first, 158 us a call against 23 on an H100 (`qgather bench gpu` reads it ~17 times a case)."""
    if device.type != "cuda":
        return None
    return lambda: _allocated_peak(torch.cuda.memory_stats_as_nested_dict(device))


def _allocated_peak(stats: dict) -> int:
    """The "allocated_bytes.all.peak" of the allocator's nested statistics (0 before CUDA's first use)."""
    return stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0)
