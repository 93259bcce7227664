"""Nothing a runner starts outlives it: how ranks, the forkserver and temp dirs notice its death.

The runner (the process that owns the pools: `qgather run/case`, a pytest session) may die any
way, SIGKILL included, so nothing here relies on it cleaning up:

* Each pool hands its ranks the read end of a "lifeline" pipe whose only write end the runner
  holds: EOF means the runner is gone. A daemon thread in every rank waits on it (and checks the
  runner's pid and start time every POLL_S, which also covers a lifeline that could not be
  passed), then removes the pool's temp dir and `os._exit`s.
* Ranks drop the copies of the forkserver's "alive" fd and the resource tracker's fd that
  multiprocessing hands every forkserver child. With those held by ranks, neither helper ever saw
  EOF when the runner died, so the forkserver stayed up and the ranks' PR_SET_PDEATHSIG (which
  fires on the forkserver's death) never did. Now the runner's death closes the last write end:
  the forkserver exits (its preloaded `forkserver_hook` then removes the runner's temp dirs), the
  ranks get SIGKILL from the kernel even if their watchdog thread cannot run, and the resource
  tracker exits.
* Pool temp dirs are named `qgather-pool-<runner pid>-*`. Removal is by the ranks' watchdog and
  the forkserver hook on the runner's death; as a last resort a new runner sweeps, on its first
  pool, the pool dirs whose owner pid is gone.
* Under spawn (QGATHER_START_METHOD=spawn, or a forkserver that could not start, which the runner
  warns about) no forkserver hook runs and the ranks' PR_SET_PDEATHSIG fires with the runner: a
  runner killed by SIGKILL leaves its pool dir to that sweep.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import threading
from multiprocessing import forkserver, resource_tracker
from typing import Any

POLL_S = 0.5
POOL_DIR_PREFIX = "qgather-pool-"
CLEAN_STOP_MARKER = ".qgather-clean-stop"
EXIT_CODE = 70  # a rank that ended because its runner died


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None if it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def runner_identity() -> tuple[int, int]:
    """(pid, start time) of this process: what ranks compare against to notice its death."""
    return os.getpid(), start_time(os.getpid()) or 0


def is_gone(pid: int, started: int) -> bool:
    """Whether process `pid` (started at `started` ticks; 0: any start) is gone or was replaced."""
    if pid <= 0:
        return False
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    now = start_time(pid)
    return now is None or (started != 0 and now != started)


def make_pool_dir() -> str:
    """A new temp dir for one pool, named after this runner so that orphans can be told apart."""
    return tempfile.mkdtemp(prefix=f"{POOL_DIR_PREFIX}{os.getpid()}-")


def remove_pool_dirs_of(pid: int) -> None:
    """Remove every pool dir of the runner `pid`."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{POOL_DIR_PREFIX}{pid}-*")):
        shutil.rmtree(path, ignore_errors=True)


def sweep_orphaned_pool_dirs() -> None:
    """Remove pool dirs whose runner is gone (a runner killed before anything else could)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{POOL_DIR_PREFIX}*-*")):
        owner = os.path.basename(path)[len(POOL_DIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and is_gone(int(owner), 0):
            shutil.rmtree(path, ignore_errors=True)


def sweep_orphaned_pool_dirs_once() -> None:
    """`sweep_orphaned_pool_dirs`, on the first pool this process starts only."""
    if not _swept:
        _swept.append(True)
        sweep_orphaned_pool_dirs()


_swept: list[bool] = []


def drop_inherited_helper_fds() -> None:
    """Close this rank's copies of the forkserver "alive" and resource tracker write ends."""
    server = forkserver._forkserver
    tracker = resource_tracker._resource_tracker
    for owner, attr in ((server, "_forkserver_alive_fd"), (tracker, "_fd")):
        fd = getattr(owner, attr, None)
        if isinstance(fd, int):
            try:
                os.close(fd)
            except OSError:
                pass
            setattr(owner, attr, None)
    if hasattr(tracker, "_pid"):
        tracker._pid = None  # a later use starts a tracker of this rank's own


def watch_runner(lifeline: Any, pid: int, started: int, pool_dir: str) -> threading.Thread:
    """Start the daemon thread that ends this rank once the runner is gone."""
    thread = threading.Thread(target=_watch, args=(lifeline, pid, started, pool_dir),
                              name="qgather-runner-watchdog", daemon=True)
    thread.start()
    return thread


def _watch(lifeline: Any, pid: int, started: int, pool_dir: str) -> None:
    while True:
        try:
            ended = lifeline is not None and lifeline.poll(POLL_S)  # readable only at EOF
        except (OSError, EOFError):
            ended = True
        if lifeline is None:
            threading.Event().wait(POLL_S)
        if ended or is_gone(pid, started):
            break
    if pool_dir:
        shutil.rmtree(pool_dir, ignore_errors=True)
    os._exit(EXIT_CODE)
