"""The runner's side of a `dcp-wsA` case: the checkpoint saved at world size A on a pool of A ranks,
into a directory of its own, before the case runs at world size B (the ranks' side, what is saved
and how it is loaded: qgather.scenarios.checkpoint).

The directory is named like the pools' temp dirs (`qgather-pool-<runner pid>-dcp-*`) so that a
runner killed mid-case leaves nothing behind (see qgather.runtime.lifeline); it is removed when the
case ends. A save that fails is the case's verdict (its errors classified as at world size A, the
reason says so), and so is a `-trained` save whose training forward received a wrong
weight; a world size A the runtime cannot give (under torchrun/SLURM: any A but the
launched world) is SKIPPED with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

from qgather.engine.classify import Classification, classify_outcome
from qgather.impls.base import Implementation
from qgather.model.case import CaseSpec, saved_spec
from qgather.model.verdict import Verdict
from qgather.runtime import CaseOutcome, OutcomeStatus, PoolSpec, PoolSpecError, get_pool
from qgather.runtime.lifeline import POOL_DIR_PREFIX
from qgather.scenarios.checkpoint import save_on_rank


class PoolOptions(Protocol):
    """What the save needs of the run's options (qgather.engine.run.RunOptions)."""

    case_timeout: float | None
    say: Callable[[str], None] | None

    def backend_for(self, world_size: int) -> str:
        """The process-group backend of a pool of `world_size` ranks."""

    def device_type(self) -> str:
        """The ranks' device type ("cpu" or "cuda")."""


def pool_of(world_size: int, options: PoolOptions) -> PoolSpec:
    """The pool of `world_size` ranks the run's options put a case (or a save) on."""
    return PoolSpec(backend=options.backend_for(world_size), world_size=world_size, device=options.device_type())


class Save(NamedTuple):
    """A dcp-wsA case's save: the checkpoint directory, or the case's classification when the save could
    not run or failed; the save's own outcome (its pool's start, its steps) where it ran."""

    path: str | None
    failure: Classification | None
    outcome: CaseOutcome | None = None


@contextlib.contextmanager
def saved_checkpoint(spec: CaseSpec, impl: Implementation, options: PoolOptions) -> Iterator[Save]:
    """In the runner: the Save once world size A saved it (or failed to). The directory is removed on exit."""
    path = tempfile.mkdtemp(prefix=f"{POOL_DIR_PREFIX}{os.getpid()}-dcp-")
    try:
        yield _save(spec, impl, options, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _save(spec: CaseSpec, impl: Implementation, options: PoolOptions, path: str) -> Save:
    size = spec.config.saved_at_world_size
    where = f"checkpoint save at world size {size}"
    pool_spec = pool_of(size, options)
    try:
        pool = get_pool(pool_spec.validate(), options.say)
    except PoolSpecError as exc:
        return Save(None, Classification(Verdict.SKIPPED, f"{where}: {exc}"))
    kwargs = {"case_id": f"{saved_spec(spec).id} (DCP save for {spec.id})", "seed": spec.seed}
    if options.case_timeout is not None:
        kwargs["timeout"] = options.case_timeout
    outcome = pool.run(save_on_rank, spec, path, **kwargs)
    if outcome.status is OutcomeStatus.OK and not any(result.stages for result in outcome.results):
        return Save(path, None, outcome)
    # judged like the case itself (qgather.engine.run): a `-trained` save's forward gathered a weight at
    # A, errors meet the adapter's own refusal rule, a HANG or CRASH keeps every rank's stacks
    found = classify_outcome(outcome, size, impl.refusal_problem)
    if found.verdict is Verdict.EXACT:
        return Save(path, None, outcome)
    return Save(None, Classification(found.verdict, f"{where}: {found.reason}", found.details), outcome)
