"""Runs one case end to end: picks where it runs, runs it on a warm rank pool (or virtually),
and builds its one CaseReport from what came back (qgather.engine.classify decides the verdict)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from qgather.engine.checkpoint import pool_of, saved_checkpoint
from qgather.engine.classify import Classification, classify_errors, classify_outcome, classify_results
from qgather.engine.evidence import detail_evidence, where_lines
from qgather.errors import UsageError
from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.impls.base import Implementation
from qgather.model.case import CaseSpec
from qgather.model.phases import Phase
from qgather.model.policy import expectation
from qgather.model.report import UNPLACED, CaseReport
from qgather.model.repro import repro_command
from qgather.model.verdict import Verdict
from qgather.runtime import CaseOutcome, PoolSpec, PoolSpecError, RankError, get_pool, start_ahead
from qgather.runtime.launch import detect_launch
from qgather.scenarios import fsdp_setup
from qgather.scenarios.registry import run_on_rank
from qgather.scenarios.virtual import run_virtual

VIRTUAL_MAX_WORLD = 1024


@dataclass(frozen=True)
class RunOptions:
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    case_timeout: float | None = None  # seconds; None: the runtime's default for the backend
    # After a HANG, re-run the case once on a fresh pool with TORCH_DISTRIBUTED_DEBUG=DETAIL, whose
    # collective fingerprint check names a mismatched collective. Costs a pool start and, when
    # nothing mismatches, a second case timeout: on for `qgather case`/`repro`, off for the suite.
    detail_on_hang: bool = False
    # Under a launcher, where a rank other than 0 writes its own failure (None: stderr); the pytest
    # plugin's goes past its output capture (qgather.pytest_plugin.session).
    say: Callable[[str], None] | None = None

    def device_type(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def backend_for(self, world_size: int) -> str:
        if self.backend != "auto":
            return self.backend
        launch = detect_launch()
        if launch is not None:  # NCCL when every rank of a node has a GPU of its own
            fits = launch.local_world_size <= torch.cuda.device_count()
            return "nccl" if self.device_type() == "cuda" and fits else "gloo"
        if self.device_type() == "cuda" and world_size <= torch.cuda.device_count():
            return "nccl"
        return "gloo"


class CaseInputError(UsageError):
    """A case that cannot be run as asked (unknown format, implementation, impossible world)."""


def check_case(spec: CaseSpec) -> Implementation:
    """The case's implementation, resolved once for the whole case, after checking it can run as asked."""
    impl = get_impl(spec.impl)  # raises UnknownImplementationError; registers the formats of its own
    if spec.fmt not in FORMATS:
        raise CaseInputError(f"case {spec.id}: unknown format {spec.fmt!r}; known: {', '.join(FORMATS)}")
    if spec.scenario != "virtual" and spec.world_size > 64:
        raise CaseInputError(
            f"case {spec.id}: world size {spec.world_size} needs the virtual scenario (real pools stop at 64)"
        )
    if spec.world_size > VIRTUAL_MAX_WORLD:
        raise CaseInputError(f"case {spec.id}: world size {spec.world_size} > {VIRTUAL_MAX_WORLD}")
    return impl


def run_case(spec: CaseSpec, options: RunOptions | None = None) -> CaseReport:
    """Run one case where `options` say and return its report.

    Raises:
        CaseInputError, UnknownImplementationError: a case that cannot run as asked (usage errors).
    """
    options = options or RunOptions()
    impl = check_case(spec)
    started = time.monotonic()
    ran = _run(spec, impl, options)
    found = ran.found
    return CaseReport(spec, found.verdict, found.reason, found.details, expectation(spec),
                      time.monotonic() - started, ran.placement,
                      repro_command(spec.id, options.backend, options.device, options.case_timeout), ran.seconds,
                      ran_on=ran.ran_on, stage=found.stage)


Seconds = tuple[tuple[str, float], ...]


class _Ran(NamedTuple):
    """What running a case gave: its classification, where it ran (CaseReport.placement, .ran_on), its steps."""

    found: Classification
    ran_on: str = ""
    placement: str = ""
    seconds: Seconds = ()


def _skip_reason(spec: CaseSpec, impl: Implementation, options: RunOptions) -> str | None:
    return impl.skip_reason(spec, torch.device(options.device_type())) or fsdp_setup.skip_reason(spec, impl)


def _run(spec: CaseSpec, impl: Implementation, options: RunOptions) -> _Ran:
    reason = _skip_reason(spec, impl, options)
    if reason:
        return _Ran(Classification(Verdict.SKIPPED, reason))
    if spec.scenario == "virtual":
        return _Ran(_run_virtual(spec, impl), "virtual")
    if spec.config.saved_at_world_size is None:
        return _run_on_pool(spec, impl, options)
    _start_own_pool_early(spec, options)
    with saved_checkpoint(spec, impl, options) as save:
        saving = save_seconds(save.outcome) if save.outcome is not None else ()
        if save.failure:
            pool = _pool_spec(spec, options)
            return _Ran(save.failure, f"{pool.backend}/{pool.device}", seconds=saving)
        ran = _run_on_pool(spec, impl, options, save.path)
        return ran._replace(seconds=added(saving, ran.seconds))


def _start_own_pool_early(spec: CaseSpec, options: RunOptions) -> None:
    """A dcp-wsA case's own CUDA pool, not up yet, starts in the background while the save's pool starts
    and saves at A: on the GPU gate these cases' pool starts were the most after each worker's first."""
    own = _pool_spec(spec, options)
    if own.device != "cuda" or spec.config.saved_at_world_size == spec.world_size:
        return
    try:
        start_ahead(own.validate())
    except PoolSpecError:
        return  # the case itself reports it


def case_pools(spec: CaseSpec, options: RunOptions) -> tuple[PoolSpec, ...]:
    """The CUDA pools a case of `spec` will run on (a dcp-wsA case's save's and its own); none for a case
    that runs on no pool (virtual, skipped) or cannot run as asked (the case itself reports that)."""
    if options.device_type() != "cuda" or spec.scenario == "virtual":
        return ()
    try:
        if _skip_reason(spec, check_case(spec), options):
            return ()
        return tuple(pool_of(size, options).validate() for size in spec.pool_sizes)
    except Exception:  # noqa: BLE001 - whatever keeps the case from running, the case itself reports
        return ()


def _pool_spec(spec: CaseSpec, options: RunOptions) -> PoolSpec:
    return pool_of(spec.world_size, options)


def _run_virtual(spec: CaseSpec, impl: Implementation) -> Classification:
    try:
        results = run_virtual(spec)
    except Exception as exc:  # noqa: BLE001 - raised before the virtual ranks split: same on every rank
        results = [exc] * spec.world_size
    errors = RankError.from_exceptions(results)
    if errors:
        return classify_errors(errors, spec.world_size, impl.refusal_problem)
    return classify_results(results)


def _run_on_pool(spec: CaseSpec, impl: Implementation, options: RunOptions,
                 *case_args) -> _Ran:
    pool_spec = _pool_spec(spec, options)
    ran_on = f"{pool_spec.backend}/{pool_spec.device}"
    try:
        pool = get_pool(pool_spec.validate(), options.say)
    except PoolSpecError as exc:  # also under torchrun/SLURM: a world size the launched job does not have
        unplaced = UNPLACED if not pool_spec.shape_problem() else ran_on
        return _Ran(Classification(Verdict.SKIPPED, str(exc)), unplaced)
    kwargs = {"case_id": spec.id, "seed": spec.seed}
    if options.case_timeout is not None:
        kwargs["timeout"] = options.case_timeout
    outcome = pool.run(run_on_rank, spec, *case_args, **kwargs)
    found = classify_outcome(outcome, spec.world_size, impl.refusal_problem)
    if found.verdict is Verdict.HANG and options.detail_on_hang and not outcome.placement:
        # not under a launcher (no local pool there): re-run it where a mismatched collective is named
        found = replace(found, details=(*found.details, *detail_evidence(pool_spec, spec, kwargs)))
    seconds = step_seconds(outcome)
    if not outcome.placement:
        return _Ran(found, ran_on, "", seconds)
    details = (*found.details, *where_lines(outcome))
    return _Ran(replace(found, details=details), ran_on, outcome.placement, seconds)


POOL_START = "pool start"
LEASE_WAIT = "GPU lease wait"
#: a pool start's phases ("pool start: ranks starting"): a breakdown of POOL_START, not steps of their own
POOL_START_PHASE = POOL_START + ": "
SAVE_STEP = Phase.SAVE.value  # a dcp-wsA case's save at A ranks, on a pool of its own


def step_seconds(outcome: CaseOutcome) -> Seconds:
    """Where the case's seconds went: the pool's start (when it was cold), then the steps of the rank
    that took longest in all (a rank that raised: the steps it ran until then). One rank's steps: the
    slowest rank of each step, summed, would count a wait twice (rank 0 slow in one step, rank 1
    waiting for it in the next collective) and add up to more than the case took."""
    ranks = [getattr(result, "seconds", ()) for result in (*outcome.results, *outcome.errors.values())]
    slowest = max(ranks, key=lambda steps: sum(seconds for _, seconds in steps), default=())
    head = ((LEASE_WAIT, outcome.lease_wait_s),) if outcome.lease_wait_s else ()
    if outcome.startup_s:
        head += ((POOL_START, outcome.startup_s - outcome.lease_wait_s),)
        head += tuple((POOL_START_PHASE + phase, seconds) for phase, seconds in outcome.startup_phases)
    return head + added(slowest)


def save_seconds(outcome: CaseOutcome) -> Seconds:
    """A dcp-wsA case's save at A ranks, as the case's seconds: its pool's start (and the lease wait)
    counted as the case's own, the save's steps together as one step, SAVE_STEP."""
    seconds = step_seconds(outcome)
    start = tuple((step, s) for step, s in seconds if _starting(step))
    saving = sum(s for step, s in seconds if not _starting(step))
    return (*start, (SAVE_STEP, saving)) if saving else start


def _starting(step: str) -> bool:
    """Whether a step of step_seconds is the pool's start (the lease wait, the start, its phases)."""
    return step in (LEASE_WAIT, POOL_START) or step.startswith(POOL_START_PHASE)


def added(*parts: Seconds) -> Seconds:
    """The seconds of several parts of one case, step by step (a step in two parts: the sum)."""
    total: dict[str, float] = {}
    for part in parts:
        for step, seconds in part:
            total[step] = total.get(step, 0.0) + seconds
    return tuple(total.items())
