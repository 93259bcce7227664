"""A warm pool of rank processes that runs one case at a time and contains every failure.

The parent sends each case (RunCase) to every rank, then waits on the ranks' reply pipes and
process sentinels together, always with a deadline:

* every rank replies                   -> OK, or ERROR (the pool stays warm after a health check)
* a rank raises, another never replies -> ERROR once the others are seen waiting for it in a
                                          collective (or at the deadline), then the pool is aborted;
                                          where they wait at a held collective (agreement.py), the
                                          ranks that answered release them and the pool stays warm
* a rank process dies                  -> CRASH with its exit code or signal, then aborted
* the deadline passes                  -> HANG, then aborted

Aborting sends SIGTERM, which makes each rank dump all its threads' Python stacks (faulthandler)
into a per-rank file before it dies, then SIGKILL for anything left; the stacks go into the
outcome, for a CRASH as for a HANG. The next case respawns.

One job, under 500 lines: what decides when to stop waiting lives beside it (replies.py, stall.py,
whereabouts.py, agreement.py), as does a restart in the background (restart.py); the rest is spawning,
exchanging and tearing down one pool's ranks, which share its state (ranks, lease, temp dir) too closely
to split further.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from qgather.runtime import gpu_lease, lifeline, protocol, whereabouts
from qgather.runtime.helpers import mp_context, signal_pid
from qgather.runtime.outcome import CaseOutcome, OutcomeStatus, RankError
from qgather.runtime.protocol import decode, encode, send
from qgather.runtime.rank import RankConfig, rank_main
from qgather.runtime.replies import WAIT_EVIDENCE_S, Replies
from qgather.runtime.restart import BackgroundRestart
from qgather.runtime.spec import PoolSpec, check_timeout, rank_cpus, rank_env, threads_per_rank, visible_gpus
from qgather.runtime.stall import StallWatch

WHERE_REPLY_S = 2.0  # a rank's whereabouts thread answers at once unless the rank holds the GIL
TERM_WAIT_S = 3.0  # SIGTERM -> death (includes the faulthandler dump)
KILL_WAIT_S = 5.0
REAP_WAIT_S = 5.0  # a dead rank's exit status comes via the forkserver, a moment after its pipe closes
STOP_WAIT_S = 5.0  # graceful stop: destroy_process_group and exit
CHECK_TIMEOUT_S = 10.0
# Collectives must never time out before the case deadline does: the parent decides, not gloo/NCCL.
PG_TIMEOUT_S = 4 * 3600.0


@dataclass
class _Rank:
    rank: int
    process: Any  # multiprocessing.process.BaseProcess
    conn: Connection
    where: Connection | None = None  # asks where the rank's case is (qgather.runtime.whereabouts)


class RankPool:
    """`world_size` rank processes in one process group, spawned on first use and reused."""

    def __init__(self, spec: PoolSpec, env: dict[str, str] | None = None,
                 before_lease_wait: Callable[[], None] | None = None, hold_collectives: bool | None = None,
                 restart_in_background: bool | None = None) -> None:
        """`before_lease_wait`: called once before a CUDA pool waits for GPU seats that other pools hold
        (the registry stops this process's idle GPU pools there, so no process waits holding idle seats).
        `hold_collectives`: runtime/agreement.py (None: the spec's choice, PoolSpec.holds_collectives).
        `restart_in_background`: start the ranks again as soon as a failed case left the pool without
        them (None: the spec's choice, PoolSpec.restarts_in_background)."""
        self.spec = spec.validate()
        self.hold_collectives = spec.holds_collectives if hold_collectives is None else hold_collectives
        self.extra_env = dict(env or {})  # on top of rank_env, e.g. TORCH_DISTRIBUTED_DEBUG=DETAIL
        self.spawn_count = 0
        self.before_lease_wait = before_lease_wait
        self._lease: gpu_lease.Lease | None = None
        self._ranks: list[_Rank] = []
        self._tmpdir: str | None = None
        self._lifeline: Connection | None = None  # the write end; closing it ends the ranks
        self._checks = 0
        self.start_phases: tuple[tuple[str, float], ...] = ()  # the last start's, phase by phase
        # A pool left without ranks by a failed case starts again in the background (restart in
        # background): on CUDA, where a start costs seconds of CUDA contexts (spec.restarts_in_background).
        self.restarts_in_background = spec.restarts_in_background if restart_in_background is None \
            else restart_in_background
        self.restart = BackgroundRestart(str(spec))
        self._last_start_ok = False
        # Held while a case (or the start) uses the ranks: another thread stops the pool only between cases.
        self.in_use = threading.Lock()

    @property
    def started(self) -> bool:
        """Whether the ranks are up (they start on the first case, or with `start`)."""
        return bool(self._ranks)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank."""
        return [r.process.pid for r in self._ranks]

    @property
    def gpus(self) -> tuple[str, ...]:
        """The GPUs (CUDA_VISIBLE_DEVICES entries) this CUDA pool's ranks run on, in rank order, while they are up."""
        return self._lease.gpus if self._lease is not None else ()

    @property
    def tmpdir(self) -> str | None:
        """The pool's temp dir (its store and stack files) while the ranks are up."""
        return self._tmpdir

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            case_id: str = "", seed: int = 0) -> CaseOutcome:
        """Run `fn(ctx, *args)` on every rank and report what happened; never raises for what
        the case does (only for a case that cannot be sent, or a bad timeout or seed).

        `timeout` (seconds) bounds the case itself, not the spawn of a cold pool; None: the
        spec's default for its backend.
        """
        asked = time.monotonic()
        restarting, (wait_label, phase_prefix) = self.restart.under_way, self.restart.labels()
        with self.in_use:
            waited = time.monotonic() - asked if restarting else 0.0
            outcome = self._run(fn, args, timeout, case_id, seed)
        if waited and not outcome.startup_s:  # the case waited for the start in the background: its pool start
            start_phases = tuple((f"{phase_prefix}{phase}", seconds) for phase, seconds in self.start_phases)
            outcome = replace(outcome, startup_s=waited, startup_phases=((wait_label, waited), *start_phases))
        # not under plain spawn: spawned ranks die with the thread that spawned them
        if self.restarts_in_background and not self._ranks and self._last_start_ok \
                and mp_context().get_start_method() == "forkserver":
            self.start_in_background()
        return outcome

    def start_in_background(self) -> None:
        """Start the ranks in a thread of their own (restart.py); a case that comes first waits for them."""
        self.restart.launch(self.in_use, self.start, first=self.spawn_count == 0)

    def _run(self, fn: Callable[..., Any], args: tuple, timeout: float | None, case_id: str,
             seed: int) -> CaseOutcome:
        blob = protocol.encode_case(fn, args)
        limit = check_timeout(timeout, self.spec.case_timeout_s)
        if not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if self._ranks and self._idle_rank_gone():
            self._teardown()  # a rank died while idle (OOM killer, a stray signal): not this case's doing
        startup = lease_wait = 0.0
        if not self._ranks:
            began = time.monotonic()
            failure = self.start(case_id)
            if failure is not None:
                return failure
            startup = time.monotonic() - began
            lease_wait = self._lease.waited_s if self._lease is not None else 0.0
        start = time.monotonic()
        try:
            replies = self._exchange(encode(protocol.RunCase(case_id, seed, blob)), limit, StallWatch(len(self._ranks)))
            note = replies.stalled
            return replace(self._conclude(replies, time.monotonic() - start, case_id, note), startup_s=startup,
                           lease_wait_s=lease_wait, startup_phases=self.start_phases if startup else ())
        except BaseException:
            # Interrupted mid-case (Ctrl-C, a bug here): the ranks' late replies would be read as
            # the next case's, so this pool's ranks cannot be trusted any more.
            self._teardown()
            raise

    def _idle_rank_gone(self) -> bool:
        # An idle rank sends nothing, so a readable pipe means EOF: the process is gone, even
        # before a forkserver has reaped it and made its sentinel ready.
        return bool(wait([w for r in self._ranks for w in (r.conn, r.process.sentinel)], timeout=0))

    def start(self, case_id: str = "") -> CaseOutcome | None:
        """Spawn the ranks and join the process group; returns the failure (for `case_id`) if that fails."""
        if self._ranks:
            return None
        start = time.monotonic()
        mp_context()  # the forkserver launched (its preloads import in the server: the spawn waits for them)
        booted = time.monotonic()
        refused = self._take_lease(case_id)
        if refused is not None:
            self._last_start_ok = False
            return refused
        try:
            leased = time.monotonic()
            self._spawn()
            spawned = time.monotonic()
            replies = self._collect(Replies(self.spec.world_size, protocol.RANK_STARTING),
                                    start + self.spec.startup_timeout_s)
            self.start_phases = (("forkserver", booted - start), ("spawn", spawned - leased),
                                 ("ranks starting", time.monotonic() - spawned),
                                 *replies.slowest_start_phases())
            self._last_start_ok = replies.status is OutcomeStatus.OK
            if self._last_start_ok:
                return None
            replies.results = [None] * self.spec.world_size  # the pids of the ranks that did start
            return self._conclude(replies, time.monotonic() - start, case_id,
                                  note=f"pool startup failed for {self.spec}")
        except BaseException:
            self._teardown()
            raise

    def shutdown(self) -> None:
        """Stop every rank (gracefully, then SIGTERM, then SIGKILL) and remove the temp dir; a restart in
        the background not yet begun does not begin."""
        self.restart.cancel()
        for r in self._ranks:
            send(r.conn, encode(protocol.Stop()))
        _wait_dead(self._ranks, STOP_WAIT_S)
        self._teardown()

    def __repr__(self) -> str:
        state = f"pids={self.pids}" if self._ranks else "not started"
        return f"RankPool({self.spec}, {state})"

    # -- spawning -------------------------------------------------------------------------

    def _take_lease(self, case_id: str) -> CaseOutcome | None:
        """Seats on the GPUs for a CUDA pool's ranks before it spawns; the failure if none came free."""
        if self.spec.device != "cuda":
            return None
        try:
            self._lease = gpu_lease.acquire(self.spec.world_size, visible_gpus(), before_wait=self.before_lease_wait)
        except (gpu_lease.LeaseTimeout, ValueError) as exc:
            return CaseOutcome(OutcomeStatus.ERROR, [None] * self.spec.world_size,
                               errors={0: RankError.from_exception(0, exc)}, case_id=case_id,
                               note=f"no GPU seats for {self.spec}")
        return None

    def _spawn(self) -> None:
        context = mp_context()
        lifeline.sweep_orphaned_pool_dirs_once()
        self._tmpdir = lifeline.make_pool_dir()
        threads = threads_per_rank(self.spec.world_size)
        env = {**rank_env(self.spec, threads, self.gpus), **self.extra_env}
        cpus = rank_cpus(self.spec)
        runner_pid, runner_start = lifeline.runner_identity()
        life_r, self._lifeline = context.Pipe(duplex=False)
        try:
            for rank in range(self.spec.world_size):
                config = RankConfig(
                    rank=rank, world_size=self.spec.world_size, backend=self.spec.backend,
                    device=self.spec.device, store_path=os.path.join(self._tmpdir, "store"),
                    stacks_path=self._stacks_path(rank), env=env, threads=threads, pg_timeout_s=PG_TIMEOUT_S,
                    cpus=cpus[rank], runner_pid=runner_pid, runner_start=runner_start, pool_dir=self._tmpdir,
                    hold_collectives=self.hold_collectives,
                )
                parent_conn, child_conn = context.Pipe(duplex=True)
                where_parent, where_child = context.Pipe(duplex=True)
                process = context.Process(target=rank_main, args=(config, child_conn, life_r, where_child),
                                          name=f"qgather-rank{rank}", daemon=True)
                process.start()
                child_conn.close()
                where_child.close()
                self._ranks.append(_Rank(rank, process, parent_conn, where_parent))
        finally:
            life_r.close()  # only the ranks keep a read end: the runner's death is their EOF
        self.spawn_count += 1

    def _stacks_path(self, rank: int) -> str:
        assert self._tmpdir is not None
        return os.path.join(self._tmpdir, f"rank{rank}.stacks")

    # -- talking to the ranks -------------------------------------------------------------

    def _exchange(self, message: bytes, timeout: float, watch: StallWatch | None = None) -> Replies:
        replies = Replies(self.spec.world_size, protocol.RANK_REPLYING)
        deadline = time.monotonic() + timeout
        for r in self._ranks:
            if not send(r.conn, message):
                self._bury(r, replies)
        return self._collect(replies, deadline, watch)

    def _collect(self, replies: Replies, deadline: float, watch: StallWatch | None = None) -> Replies:
        """Read the ranks' replies until all are in, the deadline passes, the ranks still out are seen
        waiting for one that failed, or (`watch`) the case is seen stalled for good."""
        owners: dict[Any, _Rank] = {}
        for r in self._ranks:
            owners[r.conn] = r
            owners[r.process.sentinel] = r
        while replies.pending:
            if replies.first_failure_at is not None and self._all_pending_wait_in_collectives(replies) \
                    and not self._release_held(replies):
                break
            if watch is not None and replies.first_failure_at is None:
                replies.stalled = watch.stalled(replies.pending, lambda rank: self._where(self._ranks[rank]))
                if replies.stalled:
                    break
            remaining = replies.wait_until(deadline) - time.monotonic()
            if remaining <= 0 or time.monotonic() >= deadline:
                break
            waitables = [w for r in self._ranks if r.rank in replies.pending
                         for w in (r.conn, r.process.sentinel)]
            for ready in wait(waitables, timeout=remaining):
                r = owners[ready]
                if r.rank not in replies.pending:
                    continue
                if ready is r.conn:
                    self._receive(r, replies)
                else:
                    self._bury(r, replies)
        return replies

    def _all_pending_wait_in_collectives(self, replies: Replies) -> bool:
        """Evidence, not a timer: every rank that has not answered waits at a held collective
        (runtime/agreement.py), or has been inside a collective of its case for WAIT_EVIDENCE_S
        without a break, so it waits for a rank that already failed and will never return (a rank
        merely slow to leave a collective is seen outside it)."""
        now = time.monotonic()
        for r in self._ranks:
            if r.rank not in replies.pending:
                continue
            where = self._where(r)
            frame = whereabouts.in_collective(where.frames)
            if whereabouts.at_agreement(where.frames) and where.held_at is not None:
                replies.held[r.rank] = where.held_at
            else:
                replies.held.pop(r.rank, None)
            if frame is None:
                replies.waiting.pop(r.rank, None)
            elif r.rank not in replies.waiting:
                replies.waiting[r.rank] = (frame, now)
        if replies.releasable() or (replies.exit_codes and replies.held.keys() == replies.pending):
            # At a held collective a rank waits for its group, and a member that already answered comes
            # back to this case only when released (or never: it died): no need to watch the wait.
            return True
        return all(rank in replies.waiting and now - replies.waiting[rank][1] >= WAIT_EVIDENCE_S
                   for rank in replies.pending)

    def _release_held(self, replies: Replies) -> bool:
        """Ranks wait at held collectives (runtime/agreement.py) that only ranks which answered can end,
        and every rank is alive: have those join each such wait of their groups once, so the waiting
        ranks leave (HeldBack) instead of being killed. False where there is none (the ranks still
        waiting after a release are left behind: the pool is aborted, as before)."""
        waits = replies.releasable()
        answered = [r for r in self._ranks if r.rank not in replies.pending]
        if not waits or replies.exit_codes or not all(r.process.is_alive() for r in answered):
            return False
        replies.released.update(waits)
        for r in answered:
            if mine := tuple(held for held in waits if r.rank in held.ranks):
                send(r.conn, encode(protocol.Release(mine)))
        for rank in [rank for rank, held in replies.held.items() if held in waits]:
            del replies.held[rank]
            replies.waiting.pop(rank, None)
        return True

    def _where(self, r: _Rank) -> protocol.Whereabouts:
        """Where the rank's case is (its innermost frames, what it noted); empty if it does not say."""
        if r.where is None or not r.process.is_alive():
            return protocol.Whereabouts()
        return whereabouts.ask(r.where, WHERE_REPLY_S)

    def _receive(self, r: _Rank, replies: Replies) -> None:
        try:
            data = r.conn.recv_bytes()
        except (EOFError, OSError):
            self._bury(r, replies)
            return
        self._record(r, data, replies)

    def _record(self, r: _Rank, data: bytes, replies: Replies) -> None:
        """File one rank's reply; a message this exchange cannot get raises ProtocolError."""
        replies.pending.discard(r.rank)
        try:
            message = decode(data, replies.accepts)
        except protocol.UnreadableMessage as exc:  # e.g. a result of a class the parent cannot import
            error = RankError(r.rank, type(exc.cause).__name__,
                              f"the parent could not unpickle this rank's reply: {exc.cause}")
            message = protocol.Raised(error)
        match message:
            case protocol.Returned(value=value):
                replies.results[r.rank] = value
            case protocol.Ready(pid=pid, phases=phases):
                replies.results[r.rank] = pid
                replies.start_phases[r.rank] = phases
            case protocol.Raised(error=error) | protocol.StartFailed(error=error):
                replies.errors[r.rank] = error
                replies.failed()
            case protocol.HeldBack(collective=collective):
                replies.held_back[r.rank] = collective
            case other:
                raise protocol.ProtocolError(f"rank {r.rank} sent {type(other).__qualname__}: the pool cannot file it")

    def _bury(self, r: _Rank, replies: Replies) -> None:
        """The rank's process is gone (or its pipe broke): a crash, unless it replied first."""
        if self._last_reply(r, replies):
            return
        r.process.join(timeout=REAP_WAIT_S)
        code = r.process.exitcode
        replies.exit_codes[r.rank] = code if code is not None else -signal.SIGKILL
        replies.pending.discard(r.rank)
        replies.failed()

    def _last_reply(self, r: _Rank, replies: Replies) -> bool:
        """A rank that replied and then exited (e.g. its startup error) is not a crash."""
        try:
            if not r.conn.poll(0):
                return False
            data = r.conn.recv_bytes()
        except (EOFError, OSError):
            return False
        self._record(r, data, replies)
        return True

    # -- deciding -------------------------------------------------------------------------

    def _conclude(self, replies: Replies, duration: float, case_id: str, note: str = "") -> CaseOutcome:
        """The outcome, once: a failure that left a rank behind (or the group out of step) aborts the
        ranks first, and their stacks go into it, for a CRASH as for a HANG."""
        status = replies.status
        notes: dict[int, dict[str, str]] = {}
        stacks: dict[int, str] = {}
        if status is not OutcomeStatus.OK:
            left_behind = bool(replies.pending or replies.exit_codes)
            if left_behind:
                notes = {r.rank: facts for r in self._ranks
                         if (facts := whereabouts.evidence(self._where(r), left_behind=r.rank in replies.pending
                                                           and r.process.is_alive(), asked_for=WHERE_REPLY_S))}
            notes.update(whereabouts.held_back_notes(replies.held_back))
            if left_behind or not self._healthy():
                stacks = self._abort()
        return CaseOutcome(
            status=status, results=replies.results, errors=replies.errors, stacks=stacks,
            exit_codes=replies.exit_codes, duration_s=duration, case_id=case_id,
            unfinished=tuple(sorted(replies.pending | set(replies.held_back))), held_back=replies.held_back,
            note=note, notes=notes,
        )

    def _healthy(self) -> bool:
        """After a case failed on ranks that all replied: is the process group still in step?"""
        self._checks += 1
        replies = self._exchange(encode(protocol.HealthCheck(self._checks)), CHECK_TIMEOUT_S)
        return replies.status is OutcomeStatus.OK

    def _abort(self) -> dict[int, str]:
        """Kill every rank, keeping the stacks they dump on SIGTERM (and any fatal-signal dump)."""
        alive = [r for r in self._ranks if r.process.is_alive()]
        _signal_all(alive, signal.SIGTERM)
        _wait_dead(alive, TERM_WAIT_S)
        stacks = {}
        for r in self._ranks:
            text = _read_text(self._stacks_path(r.rank))
            if text.strip():
                stacks[r.rank] = text
        self._teardown()
        return stacks

    def _teardown(self) -> None:
        alive = [r for r in self._ranks if r.process.is_alive()]
        _signal_all(alive, signal.SIGTERM)
        _wait_dead(alive, TERM_WAIT_S)
        left = [r for r in alive if r.process.is_alive()]
        _signal_all(left, signal.SIGKILL)
        _wait_dead(left, KILL_WAIT_S)
        for r in self._ranks:
            r.conn.close()
            r.process.join(timeout=0.1)
            try:
                r.process.close()
            except ValueError:  # still running after SIGKILL: leave it to multiprocessing's reaper
                pass
        self._ranks = []
        if self._lease is not None:  # the ranks are dead: their seats are free for other pools
            self._lease.release()
            self._lease = None
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def _signal_all(ranks: list[_Rank], signum: int) -> None:
    for r in ranks:
        signal_pid(r.process.pid, signum)


def _wait_dead(ranks: list[_Rank], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive = [r.process.sentinel for r in ranks if r.process.is_alive()]
        remaining = deadline - time.monotonic()
        if not alive or remaining <= 0:
            return
        wait(alive, timeout=remaining)


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
