"""Runs one case end to end: picks where it runs, runs it on a warm rank pool (or virtually),
and turns what came back into a verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from harness.cases import CaseSpec
from harness.formats import FORMATS
from harness.impls import get_impl
from harness.verdicts import CaseReport, Verdict, classify_errors, classify_results, expectation

VIRTUAL_MAX_WORLD = 1024
STACK_LINES = 12


@dataclass(frozen=True)
class RunOptions:
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    case_timeout: float | None = None  # seconds; None: the runtime's default for the backend

    def device_type(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def backend_for(self, world_size: int) -> str:
        if self.backend != "auto":
            return self.backend
        if self.device_type() == "cuda" and world_size <= torch.cuda.device_count():
            return "nccl"
        return "gloo"


class CaseInputError(ValueError):
    """A case that cannot be run as asked (unknown format, implementation, impossible world)."""


def check_case(spec: CaseSpec) -> None:
    if spec.fmt not in FORMATS:
        raise CaseInputError(f"case {spec.id}: unknown format {spec.fmt!r}; known: {', '.join(FORMATS)}")
    get_impl(spec.impl)  # raises UnknownImplementationError with the list of names
    if spec.scenario != "virtual" and spec.world_size > 64:
        raise CaseInputError(
            f"case {spec.id}: world size {spec.world_size} needs the virtual scenario (real pools stop at 64)"
        )
    if spec.world_size > VIRTUAL_MAX_WORLD:
        raise CaseInputError(f"case {spec.id}: world size {spec.world_size} > {VIRTUAL_MAX_WORLD}")


def run_case(spec: CaseSpec, options: RunOptions | None = None) -> CaseReport:
    options = options or RunOptions()
    check_case(spec)
    started = time.monotonic()
    impl = get_impl(spec.impl)
    device = torch.device(options.device_type())
    reason = impl.skip_reason(spec, device)
    if reason:
        report = CaseReport(spec, Verdict.SKIPPED, reason)
    elif spec.scenario == "virtual":
        report = _run_virtual(spec)
    else:
        report = _run_on_pool(spec, options)
    report.expectation = expectation(spec)
    report.duration_s = time.monotonic() - started
    return report


def _run_virtual(spec: CaseSpec) -> CaseReport:
    from harness.scenarios import run_virtual

    try:
        results = run_virtual(spec)
    except Exception as exc:  # noqa: BLE001 - raised before the virtual ranks split: same on every rank
        errors = dict.fromkeys(range(spec.world_size), exc)
        return CaseReport(spec, *classify_errors(spec, errors, spec.world_size, _rejections(spec)))
    errors = {rank: r for rank, r in enumerate(results) if isinstance(r, BaseException)}
    if errors:
        return CaseReport(spec, *classify_errors(spec, errors, spec.world_size, _rejections(spec)))
    return CaseReport(spec, *classify_results(spec, results))


def _rejections(spec: CaseSpec) -> frozenset[str]:
    return get_impl(spec.impl).declared_rejections()


def _run_on_pool(spec: CaseSpec, options: RunOptions) -> CaseReport:
    from harness.runtime import PoolSpec, PoolSpecError, get_pool
    from harness.scenarios import run_on_rank

    backend = options.backend_for(spec.world_size)
    pool_spec = PoolSpec(backend=backend, world_size=spec.world_size, device=options.device_type())
    try:
        pool_spec.validate()
    except PoolSpecError as exc:
        return CaseReport(spec, Verdict.SKIPPED, str(exc))
    pool = get_pool(pool_spec)
    kwargs = {"case_id": spec.id, "seed": spec.seed}
    if options.case_timeout is not None:
        kwargs["timeout"] = options.case_timeout
    outcome = pool.run(run_on_rank, spec.id, **kwargs)
    if outcome.status == "ok":
        return CaseReport(spec, *classify_results(spec, outcome.results))
    if outcome.status == "error":
        return CaseReport(spec, *classify_errors(spec, outcome.errors, spec.world_size, _rejections(spec)))
    if outcome.status == "hang":
        return CaseReport(spec, Verdict.HANG, outcome.summary().splitlines()[0], _stack_lines(outcome.stacks))
    return CaseReport(spec, Verdict.CRASH, outcome.summary().splitlines()[0])


def _stack_lines(stacks: dict[int, str]) -> list[str]:
    lines = []
    for rank, text in sorted(stacks.items()):
        lines.append(f"rank {rank} stack (innermost last):")
        lines.extend("  " + line for line in text.strip().splitlines()[-STACK_LINES:])
    return lines
