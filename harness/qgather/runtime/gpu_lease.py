"""GPU seats: every GPU holds the ranks of up to K pools at once, each rank in a seat of its own.

NCCL forbids two ranks of one communicator on one GPU, not several communicators from different
processes on it, and a case uses a few MB of a GPU and a fraction of its time: so GPUs are shared.
A pool of W ranks on a host of G visible GPUs takes m = min(W, G) of them, rank r on the (r mod m)-th,
so an NCCL pool (W <= G) has each rank on a GPU of its own, and gloo on CUDA (W > G) spreads its ranks
evenly. Each rank takes one *seat* on its GPU; a GPU has K seats (QGATHER_GPU_SEATS, set by the run's
controller from the GPUs' free memory, qgather.pytest_plugin.gpu_schedule), so K bounds the ranks,
hence the memory, that one GPU carries.

Every process of one run shares a lease directory (qgather.runtime.lease_files) with a file per seat
(`gpu<i>.seat<k>`, i an index into the caller's CUDA_VISIBLE_DEVICES, never a physical id) and a `gate`.
A holder keeps an exclusive flock on each of its seats, so a killed worker never keeps a seat.

Acquiring: take the gate (one acquirer at a time: while it counts free seats nobody else takes one, so
the count only grows), pick the m GPUs with the most free seats, take the seats. While seats are
short, the gate holder calls `before_wait` (its process stops its own idle GPU pools), then asks the
other processes for what it is short of (`_shortfall`) through the `want` flag, whose yielders stop
only that much (qgather.runtime.seat_want). Waiting for the gate itself gives nothing up. Every wait
is bounded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qgather.runtime.lease_files import (
    LEASE_DIR_ENV,
    POLL_S,
    LeaseTimeout,
    is_held,
    lease_dir,
    lock,
    make_lease_dir,
    try_lock,
)
from qgather.runtime.seat_want import Asking

LEASE_TIMEOUT_ENV = "QGATHER_GPU_LEASE_TIMEOUT"
SEATS_ENV = "QGATHER_GPU_SEATS"
DEFAULT_SEATS = 8  # where nobody measured the GPUs (a `qgather case` outside a pytest run)
DEFAULT_LEASE_TIMEOUT_S = 1800.0
GATE = "gate"
# The lease's own names, and those of its directory that its users read here too.
__all__ = ["DEFAULT_SEATS", "LEASE_DIR_ENV", "LEASE_TIMEOUT_ENV", "POLL_S", "SEATS_ENV", "Lease", "LeaseTimeout",
           "SeatsError", "acquire", "lease_timeout_s", "make_lease_dir", "ranks_per_gpu", "seats_per_gpu"]


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
    gate = lock(os.path.join(directory, GATE), deadline)
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


def _take_seats(directory: str, need: list[int], total: int, seats: int, deadline: float,
                before_wait: Callable[[], None] | None) -> tuple[list[int], dict[tuple[int, int], int]] | None:
    """(the GPUs in rank order, (GPU, seat) -> locked fd), or None at the deadline (nothing held then)."""
    asking: Asking | None = None
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
                asking = Asking.raise_want(directory, _shortfall(need, free), sum(free))
            else:
                asking.poll(_shortfall(need, free), sum(free))
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
    finally:
        if asking is not None:
            asking.lower()


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
    return [sum(1 for seat in range(seats) if not is_held(_seat_path(directory, gpu, seat)))
            for gpu in range(total)]


def _lock_seats(directory: str, order: list[int], need: list[int], seats: int) -> dict[tuple[int, int], int] | None:
    """Lock need[j] free seats on GPU order[j]; None (and nothing held) if a GPU has fewer free now."""
    held: dict[tuple[int, int], int] = {}
    for gpu, count in zip(order, need):
        got = 0
        for seat in range(seats):
            if got == count:
                break
            fd = try_lock(_seat_path(directory, gpu, seat))
            if fd is not None:
                held[(gpu, seat)] = fd
                got += 1
        if got < count:
            for fd in held.values():
                os.close(fd)
            return None
    return held


def _seat_path(directory: str, gpu: int, seat: int) -> str:
    return os.path.join(directory, f"gpu{gpu}.seat{seat}")


def _holders(directory: str, total: int, seats: int) -> str:
    """Who holds the seats of each GPU, as far as the files say."""
    parts = []
    for gpu in range(total):
        pids = []
        for seat in range(seats):
            path = _seat_path(directory, gpu, seat)
            if not is_held(path):
                continue
            try:
                with open(path) as f:
                    pids.append(f.read().strip() or "?")
            except OSError:
                pids.append("?")
        if pids:
            parts.append(f"GPU {gpu}: {len(pids)} of {seats} seats held by pid(s) {', '.join(sorted(set(pids)))}")
    return "; ".join(parts) or "no seat held now"
