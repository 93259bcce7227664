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
`want` flag, which tells every other process of the run to stop its idle GPU pools (`someone_waits`;
each process's yielder thread in qgather.runtime.registry answers it, also while its main thread waits
for the gate): no process waits while others sit on idle seats, so nobody starves and nothing
deadlocks. Waiting for the gate itself gives nothing up. Every wait is bounded.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

LEASE_DIR_ENV = "QGATHER_GPU_LEASE_DIR"
LEASE_TIMEOUT_ENV = "QGATHER_GPU_LEASE_TIMEOUT"
SEATS_ENV = "QGATHER_GPU_SEATS"
DEFAULT_SEATS = 8  # where nobody measured the GPUs (a `qgather case` outside a pytest run)
DEFAULT_LEASE_TIMEOUT_S = 1800.0
LEASE_DIR_PREFIX = "qgather-pool-"  # lifeline's sweep removes it if its owner dies
POLL_S = 0.02  # how often a waiting gate holder looks at the seats again
GATE = "gate"
WANT = "want"


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
        _lower_want(directory)
        os.close(gate)
    if taken is None:
        raise LeaseTimeout(f"no seats for {world_size} rank(s) within {limit:.0f} s "
                           f"({_holders(directory, len(gpus), seats)})")
    order, held = taken
    return Lease(tuple(gpus[i] for i in order), tuple(sorted(held)), time.monotonic() - began, list(held.values()))


def someone_waits(directory: str | None = None) -> bool:
    """Whether an acquirer of this run waits for seats: then a process should stop its idle GPU pools.
    A flag whose acquirer died (SIGKILLed while it waited) is stale, and removed."""
    directory = directory or os.environ.get(LEASE_DIR_ENV) or _own_dir
    if not directory:
        return False
    path = os.path.join(directory, WANT)
    try:
        with open(path) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return False
    if _alive(pid):
        return True
    _lower_want(directory)
    return False


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
    waited = False
    while True:
        order = _choose(need, _free_seats(directory, total, seats))
        if order is not None:
            held = _lock_seats(directory, order, need, seats)
            if held is not None:
                return order, held
        if not waited:
            if before_wait is not None:
                before_wait()
            _raise_want(directory)
            waited = True
            continue  # what before_wait freed may be enough
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


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


def _raise_want(directory: str) -> None:
    with open(os.path.join(directory, WANT), "w") as f:
        f.write(str(os.getpid()))


def _lower_want(directory: str) -> None:
    try:
        os.remove(os.path.join(directory, WANT))
    except FileNotFoundError:
        pass


def _lock(path: str, deadline: float) -> int | None:
    """The gate, waited for without giving anything up: its holder counts and takes seats in
    milliseconds, and one that must wait for seats raises `want`, to which every process's yielder
    answers (a waiter here included), so waiting for the gate sheds no warm pool."""
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
