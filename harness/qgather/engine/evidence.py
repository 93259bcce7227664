"""The evidence a HANG, CRASH or launcher run adds to a case's report: each rank's stack at the
moment it was stopped, what each rank's case noted before it stopped answering, where a case ran
under a launcher, and a TORCH_DISTRIBUTED_DEBUG=DETAIL re-run that names a mismatched collective."""

from __future__ import annotations

import os
import re

from qgather.model.case import CaseSpec
from qgather.runtime import CaseOutcome, OutcomeStatus, PoolSpec, RankPool
from qgather.runtime.outcome import case_frames, crash_elsewhere, first_impl_frame, same_error_on_every_rank
from qgather.scenarios.registry import run_on_rank

STACK_FRAMES = 6  # innermost frames shown per rank in a HANG report


def where_lines(outcome: CaseOutcome) -> list[str]:
    """Under a launcher: the job ranks and hosts the case ran on, and the stack of a rank that raised."""
    lines = [f"placement: {outcome.placement}, job ranks {','.join(map(str, outcome.job_ranks))}"]
    every_rank_same = outcome.status is OutcomeStatus.ERROR \
        and same_error_on_every_rank(outcome.errors, outcome.world_size) is not None
    if outcome.status is OutcomeStatus.OK or every_rank_same:
        return lines
    for g in sorted({*outcome.errors, *outcome.unfinished}):
        lines.append(f"rank {g} is job rank {outcome.job_ranks[g]} on host {outcome.hosts[g]}")
        error = outcome.errors.get(g)
        if error is not None and error.traceback_text:
            lines.extend(f"  {line}" for line in error.traceback_text.rstrip().splitlines()[-STACK_FRAMES:])
    return lines


def note_lines(notes: dict[int, dict[str, str]]) -> list[str]:
    """What each rank's case noted before it stopped answering (e.g. the sizes it handed the gather)."""
    return [f"rank {rank}: " + "; ".join(f"{key}: {value}" for key, value in sorted(facts.items()))
            for rank, facts in sorted(notes.items())]


DETAIL_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
DETAIL_LIMIT = 600  # characters kept of a rank's DETAIL error (the fingerprints of both collectives)
WARM_UP_S = 120.0  # the most the fresh pool's ranks may take to import the scenarios before the re-run


def detail_evidence(pool_spec: PoolSpec, spec: CaseSpec, kwargs: dict) -> list[str]:
    """Re-run a hung case once on a fresh pool under TORCH_DISTRIBUTED_DEBUG=DETAIL and say what it showed."""
    pool = RankPool(pool_spec, env=DETAIL_ENV)
    try:
        # A fresh pool's ranks import the scenarios inside their first case: on a loaded host that took
        # longer than a short case timeout, and the re-run "hung again" in an import. Here they import
        # them first (unpickling this module's function does), outside the re-run's deadline.
        pool.run(_ready, timeout=WARM_UP_S)
        outcome = pool.run(run_on_rank, spec, **kwargs)
    finally:
        pool.shutdown()
    head = "TORCH_DISTRIBUTED_DEBUG=DETAIL re-run:"
    if outcome.status is OutcomeStatus.ERROR:
        own = [_own_collective(error.message) for _, error in sorted(outcome.errors.items())]
        if all(own):
            return [f"{head} mismatched collectives: {', '.join(own)}"]
        messages: dict[str, list[int]] = {}
        for rank, error in sorted(outcome.errors.items()):
            messages.setdefault(" ".join(error.first_line(limit=DETAIL_LIMIT).split()), []).append(rank)
        return [head] + [f"  rank(s) {','.join(map(str, ranks))}: {text}" for text, ranks in messages.items()]
    if outcome.status is OutcomeStatus.HANG:
        return [f"{head} hung again; no collective mismatch detected ({outcome.summary()})"]
    return [f"{head} {outcome.headline()}"]


def _ready(ctx: object) -> None:
    """Nothing: a rank that runs it has imported this module, and with it the scenarios."""


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),?\s*"
                          r"OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?")


def _own_collective(message: str) -> str:
    """'rank 1 in BARRIER (#2)' from a ProcessGroupWrapper mismatch error: what this rank itself ran."""
    match = _FINGERPRINT.search(message)
    if match is None:
        return ""
    rank, sequence, op, shape = match.groups()
    return f"rank {rank} in {op} (#{sequence}{', shape ' + shape if shape else ''})"


def stack_lines(stacks: dict[int, str]) -> list[str]:
    """Per rank: the case thread's STACK_FRAMES innermost frames, then the innermost frame of the
    implementation under test when it is deeper than those (torch and runtime frames skipped)."""
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
        lines.extend(_crash_elsewhere_lines(text))
    return lines


def _crash_elsewhere_lines(stack_text: str) -> list[str]:
    """The thread a rank crashed in when it was not the case's: the case thread's stack above is then
    only where that thread stood (a SIGSEGV once showed the case thread encoding its error while the
    rank's whereabouts thread crashed)."""
    crash = crash_elsewhere(stack_text)
    if crash is None:
        return []
    what, frames = crash
    if not frames:
        return [f"  ... crashed ({what}) in a thread without Python frames (gloo's, OpenMP's, a library's own), "
                "not in the case's thread"]
    return [f"  ... crashed ({what}) in another thread: "
            + " <- ".join(_frame_text(frame) for frame in frames[:STACK_FRAMES])]


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
