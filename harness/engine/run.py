"""Runs one case end to end: picks where it runs, runs it on a warm rank pool (or virtually),
and turns what came back into a verdict."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import torch

from qgather.engine.checkpoint import saved_checkpoint
from qgather.errors import UsageError
from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.model.case import CaseSpec
from qgather.model.verdict import CaseReport, Verdict, classify_errors, classify_results, expectation
from qgather.scenarios import fsdp_setup
from qgather.scenarios.registry import run_on_rank
from qgather.scenarios.virtual import run_virtual

VIRTUAL_MAX_WORLD = 1024
STACK_FRAMES = 6  # innermost frames shown per rank in a HANG report


@dataclass(frozen=True)
class RunOptions:
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    case_timeout: float | None = None  # seconds; None: the runtime's default for the backend
    # After a HANG, re-run the case once on a fresh pool with TORCH_DISTRIBUTED_DEBUG=DETAIL, whose
    # collective fingerprint check names a mismatched collective. Costs a pool start and, when
    # nothing mismatches, a second case timeout: on for `qgather case`/`repro`, off for the suite.
    detail_on_hang: bool = False

    def device_type(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def backend_for(self, world_size: int) -> str:
        if self.backend != "auto":
            return self.backend
        from qgather.runtime.launch import detect_launch

        launch = detect_launch()
        if launch is not None:  # NCCL when every rank of a node has a GPU of its own
            fits = launch.local_world_size <= torch.cuda.device_count()
            return "nccl" if self.device_type() == "cuda" and fits else "gloo"
        if self.device_type() == "cuda" and world_size <= torch.cuda.device_count():
            return "nccl"
        return "gloo"


class CaseInputError(UsageError):
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
    reason = impl.skip_reason(spec, device) or fsdp_setup.skip_reason(spec, impl)
    if reason:
        report = CaseReport(spec, Verdict.SKIPPED, reason)
    elif spec.scenario == "virtual":
        report = _run_virtual(spec)
    elif spec.config.saved_at_world_size is not None:
        with saved_checkpoint(spec, options) as (checkpoint, failure):
            report = failure or _run_on_pool(spec, options, checkpoint)
    else:
        report = _run_on_pool(spec, options)
    report.expectation = expectation(spec)
    report.duration_s = time.monotonic() - started
    return report


def _run_virtual(spec: CaseSpec) -> CaseReport:
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


def _run_on_pool(spec: CaseSpec, options: RunOptions, *case_args) -> CaseReport:
    from qgather.runtime import PoolSpec, PoolSpecError, get_pool

    backend = options.backend_for(spec.world_size)
    pool_spec = PoolSpec(backend=backend, world_size=spec.world_size, device=options.device_type())
    try:
        pool_spec.validate()
    except PoolSpecError as exc:
        return CaseReport(spec, Verdict.SKIPPED, str(exc))
    try:
        pool = get_pool(pool_spec)
    except PoolSpecError as exc:  # under torchrun/SLURM: a world size the launched job does not have
        return CaseReport(spec, Verdict.SKIPPED, str(exc))
    kwargs = {"case_id": spec.id, "seed": spec.seed}
    if options.case_timeout is not None:
        kwargs["timeout"] = options.case_timeout
    outcome = pool.run(run_on_rank, spec, *case_args, **kwargs)
    report = _report_outcome(spec, options, pool_spec, kwargs, outcome)
    if outcome.placement:
        report.placement = outcome.placement
        report.details.extend(_where_lines(outcome))
    return report


def _where_lines(outcome) -> list[str]:
    """Under a launcher: the job ranks and hosts the case ran on, and the stack of a rank that raised."""
    lines = [f"placement: {outcome.placement}, job ranks {','.join(map(str, outcome.job_ranks))}"]
    every_rank_same = outcome.status == "error" and len(outcome.errors) == outcome.world_size \
        and len({(e.type_name, e.message) for e in outcome.errors.values()}) == 1
    if outcome.status == "ok" or every_rank_same:
        return lines
    for g in sorted({*outcome.errors, *outcome.unfinished}):
        lines.append(f"rank {g} is job rank {outcome.job_ranks[g]} on host {outcome.hosts[g]}")
        error = outcome.errors.get(g)
        if error is not None and error.traceback_text:
            lines.extend(f"  {line}" for line in error.traceback_text.rstrip().splitlines()[-STACK_FRAMES:])
    return lines


def _report_outcome(spec: CaseSpec, options: RunOptions, pool_spec, kwargs: dict, outcome) -> CaseReport:
    if outcome.status == "ok":
        return CaseReport(spec, *classify_results(spec, outcome.results))
    if outcome.status == "error":
        return CaseReport(spec, *classify_errors(spec, outcome.errors, spec.world_size, _rejections(spec)))
    if outcome.status == "hang":
        lines = _note_lines(outcome.notes) + _stack_lines(outcome.stacks)
        if options.detail_on_hang and not outcome.placement:  # not under a launcher: no local pool there
            lines += _detail_evidence(pool_spec, spec, kwargs)
        return CaseReport(spec, Verdict.HANG, outcome.summary().splitlines()[0], lines)
    return CaseReport(spec, Verdict.CRASH, outcome.summary().splitlines()[0], _note_lines(outcome.notes))


def _note_lines(notes: dict[int, dict[str, str]]) -> list[str]:
    """What each rank's case noted before it stopped answering (e.g. the sizes it handed the gather)."""
    return [f"rank {rank}: " + "; ".join(f"{key}: {value}" for key, value in sorted(facts.items()))
            for rank, facts in sorted(notes.items())]


DETAIL_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
DETAIL_LIMIT = 600  # characters kept of a rank's DETAIL error (the fingerprints of both collectives)


def _detail_evidence(pool_spec, spec: CaseSpec, kwargs: dict) -> list[str]:
    """Re-run a hung case once on a fresh pool under TORCH_DISTRIBUTED_DEBUG=DETAIL and say what it showed."""
    from qgather.runtime import RankPool

    pool = RankPool(pool_spec, env=DETAIL_ENV)
    try:
        outcome = pool.run(run_on_rank, spec, **kwargs)
    finally:
        pool.shutdown()
    head = "TORCH_DISTRIBUTED_DEBUG=DETAIL re-run:"
    if outcome.status == "error":
        own = [_own_collective(error.message) for _, error in sorted(outcome.errors.items())]
        if all(own):
            return [f"{head} mismatched collectives: {', '.join(own)}"]
        messages: dict[str, list[int]] = {}
        for rank, error in sorted(outcome.errors.items()):
            messages.setdefault(" ".join(error.first_line(limit=DETAIL_LIMIT).split()), []).append(rank)
        return [head] + [f"  rank(s) {','.join(map(str, ranks))}: {text}" for text, ranks in messages.items()]
    if outcome.status == "hang":
        return [f"{head} hung again; no collective mismatch detected ({outcome.summary()})"]
    return [f"{head} {outcome.summary().splitlines()[0]}"]


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),?\s*"
                          r"OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?")


def _own_collective(message: str) -> str:
    """'rank 1 in BARRIER (#2)' from a ProcessGroupWrapper mismatch error: what this rank itself ran."""
    match = _FINGERPRINT.search(message)
    if match is None:
        return ""
    rank, sequence, op, shape = match.groups()
    return f"rank {rank} in {op} (#{sequence}{', shape ' + shape if shape else ''})"


def _stack_lines(stacks: dict[int, str]) -> list[str]:
    """Per rank: the case thread's STACK_FRAMES innermost frames, then the innermost frame of the
    implementation under test when it is deeper than those (torch and runtime frames skipped)."""
    from qgather.runtime.outcome import case_frames, first_impl_frame

    lines = []
    for rank, text in sorted(stacks.items()):
        frames = case_frames(text)
        if not frames:
            lines.append(f"rank {rank}: no Python stack")
            continue
        lines.append(f"rank {rank} stack (innermost first):")
        lines.extend(f"  {_frame_text(frame)}" for frame in frames[:STACK_FRAMES])
        impl = first_impl_frame(frames)
        if impl is not None and impl not in frames[:STACK_FRAMES]:
            lines.append(f"  ... implementation frame: {_frame_text(impl)}")
    return lines


def _frame_text(frame: tuple[str, int, str]) -> str:
    file, line, func = frame
    return f"{func} ({_short_path(file)}:{line})"


def _short_path(file: str) -> str:
    """The path from its package root on (torch/distributed/...), not the whole site-packages path."""
    file = file.replace("\\", "/")
    parts = file.split("/")
    for anchor in ("site-packages", "dist-packages"):  # first: a venv may live inside the checkout
        if anchor in parts[:-1]:
            index = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[index + 1:])
    here = os.getcwd().replace("\\", "/").rstrip("/") + "/"
    if file.startswith(here):
        return file[len(here):]
    if "lib" in parts[:-1]:
        index = len(parts) - 1 - parts[::-1].index("lib")
        return "/".join(parts[index + 1:])
    return "/".join(parts[-3:])
