"""GPU leases: a pool of N NCCL ranks holds N GPUs of its own for as long as it lives.

Every process of one run (the pytest-xdist workers, or one `qgather` command) shares a lease
directory: QGATHER_GPU_LEASE_DIR, set by the run's controller, else one of this process's own.
It holds one file per GPU slot (`slot<i>`, i an index into the caller's CUDA_VISIBLE_DEVICES, never
a physical id) and a `gate`. A holder keeps an exclusive flock on each of its slots; the kernel
drops a lock when its holder dies however it dies, so a killed worker never keeps a GPU.

Acquiring N slots: take the gate (one acquirer at a time, so two acquirers never each hold half of
what both need), then take free slots until there are N. While the gate holder waits, nobody else
can take a slot, so the GPUs that holders free go to it: no acquirer starves behind smaller ones.
Before it waits, the acquirer calls `before_wait` (the registry shuts down this process's other,
idle GPU pools there), so no process waits while it holds slots: no deadlock. Every wait is bounded.
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
DEFAULT_LEASE_TIMEOUT_S = 1800.0
LEASE_DIR_PREFIX = "qgather-pool-"  # lifeline's sweep removes it if its owner dies
POLL_S = 0.02  # how often a waiting gate holder looks at the slots again
GATE = "gate"


class LeaseTimeout(RuntimeError):
    """No `count` GPUs came free within the bound; the message says who held them."""


@dataclass
class Lease:
    """GPU slots held by this process: `gpus` are their CUDA_VISIBLE_DEVICES entries, in slot order."""

    slots: tuple[int, ...]
    gpus: tuple[str, ...]
    waited_s: float = 0.0
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def release(self) -> None:
        """Give the slots back (idempotent)."""
        for fd in self._fds:
            os.close(fd)  # closing drops the flock
        self._fds.clear()


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


def acquire(count: int, gpus: Sequence[str], *, directory: str | None = None, timeout: float | None = None,
            before_wait: Callable[[], None] | None = None) -> Lease:
    """Lease `count` of the GPUs `gpus` (the caller's CUDA_VISIBLE_DEVICES entries), waiting at most
    `timeout` seconds (default: lease_timeout_s()); LeaseTimeout if they do not come free."""
    if not 0 < count <= len(gpus):
        raise ValueError(f"cannot lease {count} of {len(gpus)} GPU(s)")
    directory = directory or lease_dir()
    limit = lease_timeout_s() if timeout is None else timeout
    began = time.monotonic()
    deadline = began + limit
    gate = _lock(os.path.join(directory, GATE), deadline, before_wait)
    if gate is None:
        raise LeaseTimeout(f"no {count} GPU(s) free within {limit:.0f} s: another process kept the lease gate "
                           f"({_holders(directory, len(gpus))})")
    try:
        fds = _take_slots(directory, count, len(gpus), deadline, before_wait)
    finally:
        os.close(gate)
    if fds is None:
        raise LeaseTimeout(f"no {count} GPU(s) free within {limit:.0f} s ({_holders(directory, len(gpus))})")
    slots = tuple(sorted(fds))
    return Lease(slots, tuple(gpus[i] for i in slots), time.monotonic() - began, [fds[i] for i in slots])


def _take_slots(directory: str, count: int, total: int, deadline: float,
                before_wait: Callable[[], None] | None) -> dict[int, int] | None:
    """Slot index -> locked fd, `count` of them, or None at the deadline (nothing held then)."""
    held: dict[int, int] = {}
    waited = False
    while True:
        for slot in range(total):
            if len(held) == count:
                return held
            if slot not in held:
                fd = _try_lock(_slot_path(directory, slot))
                if fd is not None:
                    held[slot] = fd
        if len(held) == count:
            return held
        if not waited and before_wait is not None:
            before_wait()
        waited = True
        if time.monotonic() >= deadline:
            for fd in held.values():
                os.close(fd)
            return None
        time.sleep(POLL_S)


def _lock(path: str, deadline: float, before_wait: Callable[[], None] | None) -> int | None:
    waited = False
    while True:
        fd = _try_lock(path)
        if fd is not None:
            return fd
        if not waited and before_wait is not None:
            before_wait()
        waited = True
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def _try_lock(path: str) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    _note_holder(fd)
    return fd


def _note_holder(fd: int) -> None:
    """The holder's pid in the slot file, for the timeout's message (the lock, not the text, is the truth)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)


def _slot_path(directory: str, slot: int) -> str:
    return os.path.join(directory, f"slot{slot}")


def _holders(directory: str, total: int) -> str:
    """Who holds which slot, as far as the files say."""
    parts = []
    for slot in range(total):
        fd = _try_lock(_slot_path(directory, slot))
        if fd is not None:
            os.close(fd)
            continue
        try:
            with open(_slot_path(directory, slot)) as f:
                pid = f.read().strip() or "?"
        except OSError:
            pid = "?"
        parts.append(f"slot {slot} held by pid {pid}")
    return "; ".join(parts) or "no slot held now"
