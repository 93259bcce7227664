"""GPU seats: every GPU holds the ranks of up to K pools at once, each rank in a seat of its own.

NCCL forbids two ranks of one communicator on one GPU, not several communicators from different
processes on it, and a case uses a few MB of a GPU and a fraction of its time: so GPUs are shared.
A pool of W ranks on a host of G visible GPUs takes m = min(W, G) of them, rank r on the (r mod m)-th,
so an NCCL pool (W <= G) has each rank on a GPU of its own, and gloo on CUDA (W > G) spreads its ranks
evenly. Each rank takes one *seat* on its GPU; a GPU has K seats (QGATHER_GPU_SEATS, set by the run's
controller from the GPUs' free memory, qgather.pytest_plugin.gpu_schedule), so K bounds the ranks,
hence the memory, that one GPU carries.

Every process of one run shares a lease directory (QGATHER_GPU_LEASE_DIR, else one of this process's
own) with a file per seat (`gpu<i>.seat<k>`, i an index into the caller's CUDA_VISIBLE_DEVICES, never a
physical id) and a `gate`. A holder keeps an exclusive flock on each of its seats; the kernel drops a
lock when its holder dies however it dies, so a killed worker never keeps a seat.

Acquiring: take the gate (one acquirer at a time: while it counts free seats nobody else takes one, so
the count only grows), pick the m GPUs with the most free seats, take the seats. While seats are
short, the gate holder calls `before_wait` (its process stops its own idle GPU pools) and raises the
`want` flag with its pid and how many seats it is short (`_shortfall`). Every other process of the run
has a yielder thread (qgather.runtime.registry, also running while its main thread waits for the gate)
that, while the flag says seats are missing, *claims* an idle pool's seats (`claim_seats`: under the
`want.lock` flock, subtract them from the shortfall) and only then stops that pool; once the shortfall
is claimed nobody else stops anything. So one waiter short of 2 seats costs one pool, not a pool of
every other worker (which their next cases would start again, seconds of CUDA contexts each). Where
the claimed seats came free but the waiter is still short (they were on GPUs it does not need: the
shortfall is one count, not one per GPU), or where a claim frees nothing (its yielder died before the
stop) and the free seats stopped growing for REARM_S, the waiter asks again for what is still missing
(`_Asking`). So no process waits while others sit on idle seats, nobody starves and nothing deadlocks.
Waiting for the gate itself gives nothing up. Every wait is bounded.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

LEASE_DIR_ENV = "QGATHER_GPU_LEASE_DIR"
LEASE_TIMEOUT_ENV = "QGATHER_GPU_LEASE_TIMEOUT"
SEATS_ENV = "QGATHER_GPU_SEATS"
DEFAULT_SEATS = 8  # where nobody measured the GPUs (a `qgather case` outside a pytest run)
DEFAULT_LEASE_TIMEOUT_S = 1800.0
LEASE_DIR_PREFIX = "qgather-pool-"  # lifeline's sweep removes it if its owner dies
POLL_S = 0.02  # how often a waiting gate holder looks at the seats again
GATE = "gate"
WANT = "want"  # "<pid> <seats short>" of the one waiting acquirer (the gate holder)
WANT_LOCK = "want.lock"  # held while the want's shortfall is read and written back (claims, re-arms)
WANT_LOCK_WAIT_S = 10.0  # its holders hold it for a file's read and write; the bound is for a frozen one
# How long the free seats may stay still, the whole shortfall claimed but not all of it free yet,
# before the waiter takes a claim for lost and asks again. Longer than a claimed pool's stop usually
# takes (its ranks' graceful exit), so that a stop under way is not answered by a second pool; short
# beside the time a waiter loses meanwhile, which it loses only where a claim frees nothing (a
# yielder that died between its claim and its stop).
REARM_S = 2.0


class LeaseTimeout(RuntimeError):
    """No seats came free within the bound; the message says who held them."""


class SeatsError(ValueError):
    """A QGATHER_GPU_SEATS that is not a positive whole number; the message says what was set."""


@dataclass
class Lease:
    """Seats held by this process: `gpus` are the CUDA_VISIBLE_DEVICES entries of the pool's GPUs, in
    rank order (rank r runs on gpus[r % len(gpus)])."""

    gpus: tuple[str, ...]
    seats: tuple[tuple[int, int], ...]  # (GPU index, seat index) of every seat held
    waited_s: float = 0.0
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def release(self) -> None:
        """Give the seats back (idempotent)."""
        for fd in self._fds:
            os.close(fd)  # closing drops the flock
        self._fds.clear()


def seats_per_gpu() -> int:
    """K: the seats of every GPU, from QGATHER_GPU_SEATS (SeatsError if it is not a positive int)."""
    value = os.environ.get(SEATS_ENV, "").strip()
    if not value:
        return DEFAULT_SEATS
    if not value.isdigit() or int(value) < 1:
        raise SeatsError(f"{SEATS_ENV}={value!r}: the seats per GPU must be a whole number >= 1")
    return int(value)


def lease_timeout_s() -> float:
    """The bound on one acquisition: QGATHER_GPU_LEASE_TIMEOUT seconds, else 30 minutes."""
    value = os.environ.get(LEASE_TIMEOUT_ENV, "")
    try:
        return float(value) if value else DEFAULT_LEASE_TIMEOUT_S
    except ValueError:
        return DEFAULT_LEASE_TIMEOUT_S


def make_lease_dir() -> str:
    """A new lease directory for one run, named so that lifeline's sweep removes it if its owner dies."""
    return tempfile.mkdtemp(prefix=f"{LEASE_DIR_PREFIX}{os.getpid()}-gpus-")


# A process's own lease dir, when no run shares one: per process by nature (a runtime module that
# knows no pytest), like the registry's pools, and removed with them (registry.shutdown_pools).
_own_dir: str | None = None


def lease_dir() -> str:
    """The run's lease directory: QGATHER_GPU_LEASE_DIR, else one of this process's own (made once)."""
    global _own_dir
    shared = os.environ.get(LEASE_DIR_ENV)
    if shared:
        return shared
    if _own_dir is None or not os.path.isdir(_own_dir):
        _own_dir = make_lease_dir()
    return _own_dir


def remove_own_lease_dir() -> None:
    """Remove this process's own lease directory, if it made one (a shared one is its owner's)."""
    global _own_dir
    if _own_dir is not None:
        shutil.rmtree(_own_dir, ignore_errors=True)
        _own_dir = None


def ranks_per_gpu(world_size: int, gpus: int) -> list[int]:
    """Ranks of a pool of `world_size` on each of the min(world_size, gpus) GPUs it uses, in rank
    order (rank r on the (r mod m)-th): 1 each for NCCL, as even as can be for gloo on CUDA."""
    used = min(world_size, gpus)
    return [len(range(i, world_size, used)) for i in range(used)]


def acquire(world_size: int, gpus: Sequence[str], *, seats: int | None = None, directory: str | None = None,
            timeout: float | None = None, before_wait: Callable[[], None] | None = None) -> Lease:
    """Seats for a pool of `world_size` ranks on the GPUs `gpus` (the caller's CUDA_VISIBLE_DEVICES
    entries), `seats` per GPU (default: seats_per_gpu()), waiting at most `timeout` seconds (default:
    lease_timeout_s()); LeaseTimeout if they do not come free, ValueError if they never could."""
    seats = seats_per_gpu() if seats is None else seats
    if world_size < 1 or not gpus:
        raise ValueError(f"cannot seat {world_size} rank(s) on {len(gpus)} GPU(s)")
    need = ranks_per_gpu(world_size, len(gpus))
    if need[0] > seats:
        raise ValueError(f"{world_size} ranks on {len(gpus)} GPU(s) need {need[0]} seats of one GPU, "
                         f"which has {seats} ({SEATS_ENV})")
    directory = directory or lease_dir()
    limit = lease_timeout_s() if timeout is None else timeout
    began = time.monotonic()
    deadline = began + limit
    gate = _lock(os.path.join(directory, GATE), deadline)
    if gate is None:
        raise LeaseTimeout(f"no seats for {world_size} rank(s) within {limit:.0f} s: another process kept the "
                           f"lease gate ({_holders(directory, len(gpus), seats)})")
    try:
        taken = _take_seats(directory, need, len(gpus), seats, deadline, before_wait)
    finally:
        os.close(gate)
    if taken is None:
        raise LeaseTimeout(f"no seats for {world_size} rank(s) within {limit:.0f} s "
                           f"({_holders(directory, len(gpus), seats)})")
    order, held = taken
    return Lease(tuple(gpus[i] for i in order), tuple(sorted(held)), time.monotonic() - began, list(held.values()))


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
    directory = _run_dir(directory)
    if directory is None:
        return None
    with _want_locked(directory):
        want = _read_want(directory)
        if want is None or want.short <= 0 or not _alive(want.pid):
            return None
        _write_want(directory, Want(want.pid, want.short - seats))
    return Claim(directory, want.pid, seats)


def _run_dir(directory: str | None) -> str | None:
    return directory or os.environ.get(LEASE_DIR_ENV) or _own_dir


def _live_want(directory: str | None) -> Want | None:
    directory = _run_dir(directory)
    if not directory:
        return None
    want = _read_want(directory)
    if want is None or _alive(want.pid):
        return want
    _remove_stale(directory, want)
    return None


def _remove_stale(directory: str, stale: Want) -> None:
    """Remove the flag of a dead waiter, not another's raised since (under the want lock, if free now:
    a reader never waits; the next one removes it otherwise)."""
    fd = _try_lock(os.path.join(directory, WANT_LOCK))
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
    fd = _lock(os.path.join(directory, WANT_LOCK), time.monotonic() + WANT_LOCK_WAIT_S)
    if fd is None:
        raise LeaseTimeout(f"the want lock of {directory} stayed held for {WANT_LOCK_WAIT_S:.0f} s")
    try:
        yield
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: the signal said it exists


def _take_seats(directory: str, need: list[int], total: int, seats: int, deadline: float,
                before_wait: Callable[[], None] | None) -> tuple[list[int], dict[tuple[int, int], int]] | None:
    """(the GPUs in rank order, (GPU, seat) -> locked fd), or None at the deadline (nothing held then)."""
    asking: _Asking | None = None
    try:
        while True:
            free = _free_seats(directory, total, seats)
            order = _choose(need, free)
            if order is not None:
                held = _lock_seats(directory, order, need, seats)
                if held is not None:
                    return order, held
            if before_wait is not None:
                before_wait()
                before_wait = None  # once
                continue  # what it freed may be enough
            if asking is None:
                asking = _Asking.raise_want(directory, _shortfall(need, free), sum(free))
            else:
                asking.poll(_shortfall(need, free), sum(free))
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
    finally:
        if asking is not None:
            asking.lower()


@dataclass
class _Asking:
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
    def raise_want(cls, directory: str, short: int, free: int) -> _Asking:
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


def _shortfall(need: list[int], free: list[int]) -> int:
    """The seats missing on the GPUs the waiter would choose (_choose's pairing), summed over them: a
    yielder cannot pick the GPU its pool frees, so where a claimed pool's seats land on GPUs this
    waiter does not need, the re-arm asks again (exact on one GPU, and for a pool spanning every GPU)."""
    return sum(max(0, n - f) for n, f in zip(need, sorted(free, reverse=True)))


def _choose(need: list[int], free: list[int]) -> list[int] | None:
    """The GPUs for the pool's rank groups, most free seats first (ties: the lowest index), each
    group on a GPU with seats enough; None if they are not free."""
    by_room = sorted(range(len(free)), key=lambda i: (-free[i], i))
    order = by_room[:len(need)]
    if any(free[gpu] < count for gpu, count in zip(order, need)):
        return None
    return order


def _free_seats(directory: str, total: int, seats: int) -> list[int]:
    return [sum(1 for seat in range(seats) if not _is_held(_seat_path(directory, gpu, seat)))
            for gpu in range(total)]


def _lock_seats(directory: str, order: list[int], need: list[int], seats: int) -> dict[tuple[int, int], int] | None:
    """Lock need[j] free seats on GPU order[j]; None (and nothing held) if a GPU has fewer free now."""
    held: dict[tuple[int, int], int] = {}
    for gpu, count in zip(order, need):
        got = 0
        for seat in range(seats):
            if got == count:
                break
            fd = _try_lock(_seat_path(directory, gpu, seat))
            if fd is not None:
                held[(gpu, seat)] = fd
                got += 1
        if got < count:
            for fd in held.values():
                os.close(fd)
            return None
    return held


def _lock(path: str, deadline: float) -> int | None:
    """A lock file's flock by `deadline`, else None. The gate is waited for without giving anything up:
    its holder counts and takes seats in milliseconds, and one that must wait for seats raises `want`,
    to which every process's yielder answers (a waiter here included), so waiting for the gate sheds
    no warm pool."""
    while True:
        fd = _try_lock(path)
        if fd is not None:
            return fd
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def _is_held(path: str) -> bool:
    fd = _try_lock(path, note=False)
    if fd is None:
        return True
    os.close(fd)
    return False


def _try_lock(path: str, note: bool = True) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if note:
        _note_holder(fd)
    return fd


def _note_holder(fd: int) -> None:
    """The holder's pid in the seat file, for the timeout's message (the lock, not the text, is the truth)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)


def _seat_path(directory: str, gpu: int, seat: int) -> str:
    return os.path.join(directory, f"gpu{gpu}.seat{seat}")


def _holders(directory: str, total: int, seats: int) -> str:
    """Who holds the seats of each GPU, as far as the files say."""
    parts = []
    for gpu in range(total):
        pids = []
        for seat in range(seats):
            path = _seat_path(directory, gpu, seat)
            if not _is_held(path):
                continue
            try:
                with open(path) as f:
                    pids.append(f.read().strip() or "?")
            except OSError:
                pids.append("?")
        if pids:
            parts.append(f"GPU {gpu}: {len(pids)} of {seats} seats held by pid(s) {', '.join(sorted(set(pids)))}")
    return "; ".join(parts) or "no seat held now"
