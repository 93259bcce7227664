"""External launcher mode: every rank is already a process (torchrun, SLURM), pytest runs on each.

Every rank runs every case in step (same collection, same order). A case of N ranks runs on a
sub-group of N job ranks, intra-node or cross-node (`job.placement`); the other ranks skip it but
still take part in agreeing on its outcome. There is no process to kill here, so each step is
bounded instead:

* start: every rank posts "at case k" to the job's store and waits (bounded) for all the others;
* run: the members run the case in-process on a group whose collectives time out just after the
  case timeout; a watchdog thread on each member snapshots its stacks and posts a HANG report at
  the timeout, or, once a peer has failed, posts WAITING as soon as its case has sat inside a
  collective for WAIT_EVIDENCE_S; a case thread that never comes back ends its process;
* agree: each rank posts its RankReport and waits (bounded) for everyone's; the first rank done (or
  timed out) fixes which reports count with a compare-and-set, so every rank merges the same
  reports into the same CaseOutcome. A rank with no report by then is lost: the job is unusable,
  every remaining rank says so, and the session stops with the same non-zero code everywhere.

The store side channel and the case groups are runtime/job.py's; this module runs the cases.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from qgather.runtime import whereabouts
from qgather.runtime.job import LOST_EXIT_CODE, PG_MARGIN_S, REPORT_MARGIN_S, JobWorld, bind_device, placement
from qgather.runtime.launch import Launch, detect_launch
from qgather.runtime.outcome import CaseOutcome, OutcomeStatus, RankError, same_error_on_every_rank
from qgather.runtime.protocol import PICKLE_PROTOCOL, ProtocolError, RankReport, ReportState, encode_case
from qgather.runtime.rank import CaseContext, to_cpu
from qgather.runtime.spec import PoolSpec, PoolSpecError, check_timeout

HANG_GRACE_MIN_S = 10.0  # after posting HANG, a case thread gets max(this, timeout) to come back
START_MARGIN_S = 15.0
WHERE_POLL_S = 0.1
WAIT_EVIDENCE_S = 1.0  # as in RankPool: inside a collective this long after a peer failed = waiting for it

_world: JobWorld | None = None


def _shared_world(launch: Launch) -> JobWorld:
    global _world
    if _world is None:
        _world = JobWorld(launch)
    return _world


def world_broken() -> str:
    """Why the launched job can run no more cases ("" while it can)."""
    return _world.broken if _world is not None else ""


def agree_exit_status(status: int) -> int:
    """Under a launcher, the exit code every rank agrees on; otherwise `status`."""
    if _world is None or not _world.joined:
        return status
    return _world.agree_exit(status)


class ExternalPool:
    """Same `run` as RankPool, for a world the launcher already made."""

    def __init__(self, spec: PoolSpec, world: tuple[int, int], say: Callable[[str], None] | None = None) -> None:
        """`say`: where this rank writes its own failure (ranks other than 0 print nothing else);
        default stderr. pytest's plugin passes one that writes past its output capture."""
        rank, world_size = world
        if spec.shape_problem():
            raise PoolSpecError(f"{spec}: {spec.shape_problem()}")
        problem = _external_problem(spec, world_size)
        if problem:
            raise PoolSpecError(problem)
        self.spec = spec
        self._say = say or _to_stderr
        launch = detect_launch()
        if launch is None or (launch.rank, launch.world_size) != (rank, world_size):
            launch = Launch("torchrun", rank, world_size, 0, world_size, "0", "", "")
        self._world = _shared_world(launch)

    @property
    def rank(self) -> int:
        """This process's rank in the launched job."""
        return self._world.rank

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            case_id: str = "", seed: int = 0) -> CaseOutcome:
        """Run `fn(ctx, *args)` on the case's members of the job; every rank returns the same outcome."""
        encode_case(fn, args)  # the same one-line error as a RankPool for an unsendable case
        limit = check_timeout(timeout, self.spec.case_timeout_s)
        world = self._world
        if not world.broken:
            world.join(self.spec)
        if not world.broken:
            step = world.begin_case()
        if world.broken:
            return self._unusable(case_id)
        members, kind = placement(self.spec.world_size, world.nodes, case_id,
                                  os.environ.get("QGATHER_PLACEMENT", "mixed"))
        key, group = world.case_group(self.spec.backend, members, limit)
        start = time.monotonic()
        if world.rank in members:
            result, error = self._run_here(step, fn, args, limit, case_id, seed, members, key, group)
            state = ReportState.DONE
        else:
            result, error, state = None, None, ReportState.IDLE
        mine = RankReport(state, world.rank, world.host, time.monotonic() - start, result, error)
        world.post(step, mine)
        reports = world.collect(step, start + limit + REPORT_MARGIN_S)
        outcome = _merge(reports, members, kind, world.hosts, case_id)
        if outcome.status is not OutcomeStatus.OK and not _rejected_everywhere(outcome):
            world.retire(key)
        # The next case waits for a rank whose case thread is late (hung, or in a collective that times out).
        world.start_wait_s = limit + max(limit, HANG_GRACE_MIN_S) + PG_MARGIN_S + START_MARGIN_S
        lost = [r for r in range(world.world_size) if r not in reports]
        if lost:
            world.broken = f"case {case_id!r}: {world.who(lost)} sent no report within {limit + REPORT_MARGIN_S:.0f} s"
        self._say_own_failure(mine, outcome, case_id)
        return outcome

    def shutdown(self) -> None:
        """The launcher owns the processes; only the process group this runtime made goes."""
        self._world.close()

    def _unusable(self, case_id: str) -> CaseOutcome:
        return CaseOutcome(OutcomeStatus.CRASH, [None] * self.spec.world_size, case_id=case_id,
                           note=f"the launched job is unusable: {self._world.broken}")

    def _run_here(self, step: int, fn: Callable[..., Any], args: tuple[Any, ...], limit: float, case_id: str,
                  seed: int, members: tuple[int, ...], key: tuple, group: Any) -> tuple[Any, RankError | None]:
        world = self._world
        watchdog = _Watchdog(world, step, limit, max(limit, HANG_GRACE_MIN_S), case_id)
        watchdog.start()
        try:
            return run_case_on_rank(self, fn, args, seed, case_id, members, key, group)
        finally:
            watchdog.finish()

    def _say_own_failure(self, mine: RankReport, outcome: CaseOutcome, case_id: str) -> None:
        """Ranks other than 0 print nothing, except their own failure (rank 0's is in the report)."""
        if self.rank == 0 or outcome.ok or _rejected_everywhere(outcome):
            return
        error = mine.error
        if error is None and mine.state in (ReportState.DONE, ReportState.IDLE):
            return
        what = (f"raised {error.first_line()}\n{error.traceback_text}" if error is not None
                else f"{mine.state}" + (f"; stacks:\n{mine.stacks}" if mine.stacks else ""))
        self._say(f"qgather: job rank {self.rank} on {self._world.host}: case {case_id}: {what}")


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_case_on_rank(pool: ExternalPool, fn: Callable[..., Any], args: tuple[Any, ...], seed: int, case_id: str,
                     members: tuple[int, ...], key: tuple, group: Any) -> tuple[Any, RankError | None]:
    """Barrier, seed, run the case on this rank: (result, None) or (None, its error)
    (outcome.CASE_FRAME: this name is looked for in stacks)."""
    spec, world = pool.spec, pool._world
    rank = members.index(world.rank)
    try:
        device = bind_device(spec)
        barrier(group)
        torch.manual_seed(seed)
        random.seed(seed)
        ctx = CaseContext(rank, len(members), spec.backend, device, group, seed, case_id,
                          lambda: world.mesh(key, device))
        result = to_cpu(fn(ctx, *args))
        pickle.dumps(result, protocol=PICKLE_PROTOCOL)  # fail here, as this rank's error
        return result, None
    except Exception as exc:  # not BaseException: Ctrl-C must still stop pytest on this rank
        return None, RankError.from_exception(rank, exc)


def barrier(group: Any) -> None:
    """The rank's own barrier before each case (whereabouts.OWN_BARRIERS: not a case's collective)."""
    dist.barrier(group=group)


class _Watchdog(threading.Thread):
    """Posts this rank's report when the case cannot: at the timeout (HANG, with every thread's
    stack), or as soon as it is seen waiting in a collective for a peer that failed. A case
    thread that does not come back within `grace` after that ends the process."""

    def __init__(self, world: JobWorld, step: int, timeout: float, grace: float, case_id: str) -> None:
        super().__init__(name="qgather-watchdog", daemon=True)
        self.world, self.step, self.timeout, self.grace, self.case_id = world, step, timeout, grace, case_id
        self.case_thread = threading.get_ident()
        self._done = threading.Event()

    def run(self) -> None:
        """Watch the case; post for it if it does not come back, and end the process if it never does."""
        state = self._watch()
        if state is None:
            return
        stacks = whereabouts.dump_stacks()
        self.world.post(self.step, RankReport(state, self.world.rank, self.world.host, self.timeout, stacks=stacks))
        if self._done.wait(self.grace):
            return
        print(f"qgather: job rank {self.world.rank} on {self.world.host}: case {self.case_id!r} still blocked "
              f"{self.grace:.0f} s after it was reported {state}; exiting with code {LOST_EXIT_CODE}. "
              f"Stacks:\n{stacks}", file=sys.stderr, flush=True)
        os._exit(LOST_EXIT_CODE)

    def _watch(self) -> ReportState | None:
        """None when the case returned; else HANG or WAITING."""
        deadline = time.monotonic() + self.timeout
        waiting_since: float | None = None
        while not self._done.wait(min(WHERE_POLL_S, max(0.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= deadline:
                return ReportState.HANG
            if not self.world.peer_failed(self.step):
                continue
            if whereabouts.in_collective(whereabouts.frames_of(self.case_thread)) is None:
                waiting_since = None
            elif waiting_since is None:
                waiting_since = now
            elif now - waiting_since >= WAIT_EVIDENCE_S:
                return ReportState.WAITING
        return None

    def finish(self) -> None:
        """The case came back: stop watching."""
        self._done.set()
        self.join(timeout=5.0)


def _merge(reports: dict[int, RankReport], members: tuple[int, ...], kind: str, hosts: list[str],
           case_id: str) -> CaseOutcome:
    """The case's outcome over its group (indexed by group rank), the same on every job rank."""
    size = len(members)
    results: list[Any] = [None] * size
    errors: dict[int, RankError] = {}
    stacks: dict[int, str] = {}
    unfinished, lost, hung = [], [], False
    for g, r in enumerate(members):
        match reports.get(r):
            case None:
                lost.append(g)
            case RankReport(state=ReportState.HANG | ReportState.WAITING as state, stacks=text):
                unfinished.append(g)
                stacks[g] = text
                hung = hung or state is ReportState.HANG
            case RankReport(state=ReportState.DONE, error=None, result=result):
                results[g] = result
            case RankReport(state=ReportState.DONE, error=error):
                errors[g] = error
            case other:
                raise ProtocolError(f"job rank {r}, a member of case {case_id!r}, reported {other.state}")
    status = (OutcomeStatus.CRASH if lost else OutcomeStatus.HANG if hung
              else OutcomeStatus.ERROR if errors else OutcomeStatus.OK)
    elapsed = [reports[r].elapsed for r in members if r in reports] or [0.0]
    note = "; ".join(f"rank {g} (job rank {members[g]} on {hosts[members[g]]}) sent no report" for g in lost)
    return CaseOutcome(status=status, results=results, errors=errors, stacks=stacks, duration_s=max(elapsed),
                       case_id=case_id, unfinished=tuple(unfinished + lost), note=note, placement=kind,
                       job_ranks=members, hosts=tuple(hosts[r] for r in members))


def _rejected_everywhere(outcome: CaseOutcome) -> bool:
    """Every rank raised the same error: no collective was left half-done, the group is reusable."""
    return outcome.status is OutcomeStatus.ERROR and same_error_on_every_rank(outcome.errors,
                                                                              outcome.world_size) is not None


def _external_problem(spec: PoolSpec, world_size: int) -> str:
    if spec.world_size > world_size:
        return (f"external launcher: world size is fixed at {world_size} by torchrun/SLURM "
                f"(WORLD_SIZE), but {spec} asks for {spec.world_size}")
    if spec.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() == 0):
        return f"external launcher: {spec} needs a GPU, but none is visible on this node"
    return ""
