"""A waiter's ask for GPU seats (qgather.runtime.gpu_lease), answered by the other processes of the run.

While seats are short, the gate holder raises the `want` flag with its pid and how many seats it is short
(qgather.runtime.gpu_lease's shortfall). Every other process of the run has a yielder thread
(qgather.runtime.registry, also running while its main thread waits for the gate) that, while the flag
says seats are missing, *claims* an idle pool's seats (`claim_seats`: under the `want.lock` flock,
subtract them from the shortfall) and only then stops that pool; once the shortfall is claimed nobody
else stops anything. So one waiter short of 2 seats costs one pool, not a pool of every other worker
(which their next cases would start again, seconds of CUDA contexts each). Where the claimed seats came
free but the waiter is still short (they were on GPUs it does not need: the shortfall is one count, not
one per GPU), or where a claim frees nothing (its yielder died before the stop) and the free seats
stopped growing for REARM_S, the waiter asks again for what is still missing (`Asking`). So no process
waits while others sit on idle seats, nobody starves and nothing deadlocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from qgather.runtime.lease_files import LeaseTimeout, alive, lock, run_dir, try_lock

WANT = "want"  # "<pid> <seats short>" of the one waiting acquirer (the gate holder)
WANT_LOCK = "want.lock"  # held while the want's shortfall is read and written back (claims, re-arms)
WANT_LOCK_WAIT_S = 10.0  # its holders hold it for a file's read and write; the bound is for a frozen one
# How long the free seats may stay still, the whole shortfall claimed but not all of it free yet,
# before the waiter takes a claim for lost and asks again. Longer than a claimed pool's stop usually
# takes (its ranks' graceful exit), so that a stop under way is not answered by a second pool; short
# beside the time a waiter loses meanwhile, which it loses only where a claim frees nothing (a
# yielder that died between its claim and its stop).
REARM_S = 2.0


@dataclass(frozen=True)
class Want:
    """The waiting acquirer's flag: its pid, and the seats it is still short of less what yielders
    claimed (<= 0: claimed in full, nobody else need stop a pool)."""

    pid: int
    short: int

    def text(self) -> str:
        return f"{self.pid} {self.short}"


@dataclass(frozen=True)
class Claim:
    """Seats a yielder promised to free for the waiter `pid` (claim_seats); given back if it cannot."""

    directory: str
    pid: int
    seats: int

    def give_back(self) -> None:
        """The pool could not be stopped: the seats are missing again, for another yielder to claim."""
        with _want_locked(self.directory):
            want = _read_want(self.directory)
            if want is not None and want.pid == self.pid:
                _write_want(self.directory, Want(want.pid, want.short + self.seats))


def someone_waits(directory: str | None = None) -> bool:
    """Whether an acquirer of this run waits for seats (claimed in full or not): then no spare pool
    should be started. A flag whose acquirer died (SIGKILLed while it waited) is stale, and removed."""
    return _live_want(directory) is not None


def seats_wanted(directory: str | None = None) -> int:
    """The seats the waiting acquirer of this run still lacks that no yielder has claimed (0 if none
    waits): while > 0 a process should claim and stop an idle GPU pool (claim_seats)."""
    want = _live_want(directory)
    return max(0, want.short) if want is not None else 0


def claim_seats(seats: int, directory: str | None = None) -> Claim | None:
    """Claim `seats` of the waiter's shortfall for a pool the caller will stop, or None if nothing is
    missing (then it stops nothing). Read and written back under the want lock, so that of several
    yielders only as many claim as the shortfall needs."""
    directory = run_dir(directory)
    if directory is None:
        return None
    with _want_locked(directory):
        want = _read_want(directory)
        if want is None or want.short <= 0 or not alive(want.pid):
            return None
        _write_want(directory, Want(want.pid, want.short - seats))
    return Claim(directory, want.pid, seats)


def _live_want(directory: str | None) -> Want | None:
    directory = run_dir(directory)
    if not directory:
        return None
    want = _read_want(directory)
    if want is None or alive(want.pid):
        return want
    _remove_stale(directory, want)
    return None


def _remove_stale(directory: str, stale: Want) -> None:
    """Remove the flag of a dead waiter, not another's raised since (under the want lock, if free now:
    a reader never waits; the next one removes it otherwise)."""
    fd = try_lock(os.path.join(directory, WANT_LOCK))
    if fd is None:
        return
    try:
        if _read_want(directory) == stale:
            _remove_want(directory)
    finally:
        os.close(fd)


def _read_want(directory: str) -> Want | None:
    try:
        with open(os.path.join(directory, WANT)) as f:
            pid, short = f.read().split()
        return Want(int(pid), int(short))
    except (OSError, ValueError):
        return None


def _write_want(directory: str, want: Want) -> None:
    """Written whole and renamed into place: a reader without the lock sees the old flag or the new."""
    path = os.path.join(directory, WANT)
    with open(f"{path}.{os.getpid()}", "w") as f:
        f.write(want.text())
    os.replace(f"{path}.{os.getpid()}", path)


def _remove_want(directory: str) -> None:
    try:
        os.remove(os.path.join(directory, WANT))
    except FileNotFoundError:
        pass


@contextmanager
def _want_locked(directory: str) -> Iterator[None]:
    fd = lock(os.path.join(directory, WANT_LOCK), time.monotonic() + WANT_LOCK_WAIT_S)
    if fd is None:
        raise LeaseTimeout(f"the want lock of {directory} stayed held for {WANT_LOCK_WAIT_S:.0f} s")
    try:
        yield
    finally:
        os.close(fd)


@dataclass
class Asking:
    """The gate holder's want flag while it waits: raised with its shortfall, and asked again (re-armed)
    for what is still missing once the yielders claimed it all and either every claimed seat came free
    (they were on GPUs this waiter does not need) or the free seats stopped growing for REARM_S (a
    claim will not come free)."""

    directory: str
    free_at_raise: int
    free: int  # the free seats when they last grew
    grew_at: float
    asked: int  # every seat asked for (the first shortfall, plus each re-arm's): less the flag's, the claimed

    @classmethod
    def raise_want(cls, directory: str, short: int, free: int) -> Asking:
        with _want_locked(directory):
            _write_want(directory, Want(os.getpid(), short))
        return cls(directory, free, free, time.monotonic(), short)

    def poll(self, short: int, free: int) -> None:
        """Called at each look at the seats, still `short` of them with `free` free."""
        now = time.monotonic()
        if free > self.free:
            self.free, self.grew_at = free, now
        want = _read_want(self.directory)
        left = want.short if want is not None else 0
        if left > 0:
            return  # not all claimed yet
        landed_all = free - self.free_at_raise >= self.asked - left  # a seat an abort freed counts too
        if landed_all or now - self.grew_at >= REARM_S:
            self._rearm(short)
            self.grew_at = now  # a stalled claim is waited for REARM_S again

    def _rearm(self, short: int) -> None:
        with _want_locked(self.directory):
            want = _read_want(self.directory)
            left = want.short if want is not None else 0
            if left <= 0:  # not given back meanwhile
                _write_want(self.directory, Want(os.getpid(), short))
                self.asked += short - left

    def lower(self) -> None:
        """Served or given up: under the lock, so that no claim writes the flag back after it."""
        with _want_locked(self.directory):
            _remove_want(self.directory)
