"""A run's lease directory and the flocks on its files, shared by the seats (qgather.runtime.gpu_lease)
and a waiter's ask for them (qgather.runtime.seat_want).

Every process of one run shares one directory (QGATHER_GPU_LEASE_DIR, else one of this process's own).
A lock file's holder keeps an exclusive flock on it; the kernel drops a lock when its holder dies however
it dies, so a killed worker never keeps one. Every wait for a lock is bounded.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

LEASE_DIR_ENV = "QGATHER_GPU_LEASE_DIR"
LEASE_DIR_PREFIX = "qgather-pool-"  # lifeline's sweep removes it if its owner dies
POLL_S = 0.02  # how often a waiter looks at a lock (or the seats) again


class LeaseTimeout(RuntimeError):
    """A bounded wait on the lease's files ran out (no seats came free, or a lock stayed held); the
    message says who held them."""


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


def run_dir(directory: str | None = None) -> str | None:
    """`directory`, else the run's lease directory if there is one already (never makes one)."""
    return directory or os.environ.get(LEASE_DIR_ENV) or _own_dir


def remove_own_lease_dir() -> None:
    """Remove this process's own lease directory, if it made one (a shared one is its owner's)."""
    global _own_dir
    if _own_dir is not None:
        shutil.rmtree(_own_dir, ignore_errors=True)
        _own_dir = None


def lock(path: str, deadline: float) -> int | None:
    """A lock file's flock by `deadline`, else None. Waiting gives nothing up: the gate's holder counts
    and takes seats in milliseconds, and one that must wait for seats asks the others through `want`
    (qgather.runtime.seat_want), to which every process's yielder answers (a waiter here included)."""
    while True:
        fd = try_lock(path)
        if fd is not None:
            return fd
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def is_held(path: str) -> bool:
    fd = try_lock(path, note=False)
    if fd is None:
        return True
    os.close(fd)
    return False


def try_lock(path: str, note: bool = True) -> int | None:
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


def alive(pid: int) -> bool:
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
