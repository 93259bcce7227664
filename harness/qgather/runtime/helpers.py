"""The multiprocessing helpers that pools start ranks through: a forkserver with torch preloaded and
the resource tracker; what this runtime started, it stops (`stop_helpers`).

A forkserver forks each rank from a process that has already imported torch, so a (re)spawned rank
starts in well under a second; QGATHER_START_METHOD=spawn (or a platform without forkserver) uses
plain spawn instead. Either way multiprocessing runs a resource tracker. Both helpers are children
of the runner; lifeline.py says how they end when the runner dies without stopping them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, resource_tracker, util
from typing import Any

from qgather.runtime import lifeline

HELPER_STOP_S = 5.0
# A Unix socket's path holds at most 107 bytes (Linux); the forkserver binds its socket at
# <multiprocessing's temp dir: TMPDIR/pymp-XXXXXXXX>/listener-XXXXXXXX, 32 bytes below TMPDIR.
SOCKET_PATH_MAX = 107
SOCKET_PATH_BELOW_TMPDIR = len("/pymp-12345678/listener-12345678")
SHORT_TEMP_BASES = ("/tmp", "/var/tmp", "/usr/tmp")  # tempfile's own fallbacks, in its order
# Preloaded by the forkserver, so a (re)spawned rank starts without paying the torch import.
FORKSERVER_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.device_mesh", "torch.distributed.fsdp", "torch._dynamo",
    "qgather.runtime.rank", "qgather.runtime.forkserver_hook",
]
# More modules for the forkserver to preload, comma-separated (e.g. transformer_engine.pytorch on a
# GPU host, whose import otherwise costs each new pool's first case seconds). A module that
# initialized the CUDA driver there would break every rank forked from it: only name modules whose
# import does not (the GPU job checks transformer_engine.pytorch before it sets this).
PRELOAD_ENV = "QGATHER_FORKSERVER_PRELOAD"


def fork_safe(modules: list[str]) -> list[str]:
    """The modules whose import leaves CUDA usable in a forked child, as the forkserver's ranks are
    forked: imported here, then a forked child allocates on the GPU (an import that initialized the
    CUDA driver makes that fail). Run it in a process of its own: it imports the modules."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    safe = []
    for name in modules:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - not importable here: nothing to preload
            continue
        pid = os.fork()
        if pid == 0:
            try:
                import torch  # the runtime's helpers import no torch: the runner may not have it loaded

                torch.zeros(1, device="cuda").add_(1)
                torch.cuda.synchronize()
                os._exit(0)
            except BaseException:  # noqa: BLE001 - the child reports by its exit code only
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == 0:
            safe.append(name)
    return safe


COMPILE_WARMUP = "qgather.runtime.compile_warmup"


def preload_compile_warmup() -> str | None:
    """Have the next forkserver this process starts warm torch.compile up for its ranks
    (qgather.runtime.compile_warmup): for a run that has compiled cases, called before its first pool."""
    return preload_for_run([COMPILE_WARMUP])


def preload_for_run(modules: list[str]) -> str | None:
    """Have the next forkserver this process starts preload `modules` too (what each of the run's ranks
    would otherwise import on its first case), before the run's first pool. Through PRELOAD_ENV, which
    the forkserver reads when it starts. Returns the variable's previous value, for `restore_preload`
    when the run ends (a later run in this process, or a subprocess, starts without them)."""
    previous = os.environ.get(PRELOAD_ENV)
    names = _preload_names()
    missing = [name for name in modules if name not in names]
    if missing:
        os.environ[PRELOAD_ENV] = ",".join([*names, *missing])
    return previous


def restore_preload(previous: str | None) -> None:
    """PRELOAD_ENV as it was before `preload_compile_warmup`."""
    if previous is None:
        os.environ.pop(PRELOAD_ENV, None)
    else:
        os.environ[PRELOAD_ENV] = previous


def forkserver_preload() -> list[str]:
    """FORKSERVER_PRELOAD plus the modules QGATHER_FORKSERVER_PRELOAD names."""
    return FORKSERVER_PRELOAD + [name for name in _preload_names() if name not in FORKSERVER_PRELOAD]


def _preload_names() -> list[str]:
    """The modules PRELOAD_ENV names, comma-separated."""
    return [name.strip() for name in os.environ.get(PRELOAD_ENV, "").split(",") if name.strip()]

_owned_helpers: dict[str, int | None] = {}  # multiprocessing helpers this runtime started


def mp_context() -> Any:
    """A forkserver that has torch preloaded, or plain spawn where that is not available.

    Either way multiprocessing runs a resource tracker; what this runtime started, it stops.
    """
    tracker_started = _helper_pid("tracker") is None
    context = _forkserver_context() or mp.get_context("spawn")
    if tracker_started:
        resource_tracker.ensure_running()
        _owned_helpers["tracker"] = _helper_pid("tracker")
    return context


def _forkserver_context() -> Any:
    method = os.environ.get("QGATHER_START_METHOD", "forkserver")
    if method != "forkserver" or "forkserver" not in mp.get_all_start_methods():
        return None
    context = mp.get_context("forkserver")
    server = forkserver._forkserver
    started = _helper_pid("forkserver") is None
    if started:
        context.set_forkserver_preload(forkserver_preload())
    try:
        if started:
            fit_socket_path()
        with _nvml_cuda_checks():
            server.ensure_running()
    except Exception as exc:  # noqa: BLE001 - whatever stops the forkserver, spawn still works
        warnings.warn(f"qgather: the forkserver did not start ({type(exc).__name__}: {exc}); ranks start "
                      "with spawn: slower, and a runner killed by SIGKILL leaves its pool dir to the next "
                      "run's sweep", RuntimeWarning, stacklevel=2)
        return None
    if started:
        _owned_helpers["forkserver"] = _helper_pid("forkserver")
    return context


def fit_socket_path() -> str | None:
    """Below a deep TMPDIR (pytest's tmp_path under xdist is one) the forkserver's socket path is too
    long to bind, and a runner fell back to spawn without a word. Give multiprocessing its temp dir
    under the first of tempfile's fallback dirs where the socket fits, removed at exit as its own
    would be. Returns that dir (None: TMPDIR fits, or multiprocessing already has its temp dir)."""
    config = mp.current_process()._config
    if config.get("tempdir") is not None or len(tempfile.gettempdir()) + SOCKET_PATH_BELOW_TMPDIR <= SOCKET_PATH_MAX:
        return None
    for base in SHORT_TEMP_BASES:
        if len(base) + SOCKET_PATH_BELOW_TMPDIR <= SOCKET_PATH_MAX and os.access(base, os.W_OK | os.X_OK):
            tempdir = tempfile.mkdtemp(prefix="pymp-", dir=base)
            # what multiprocessing.util.get_temp_dir registers for the dir it makes itself
            util.Finalize(None, util._remove_temp_dir, args=(shutil.rmtree, tempdir), exitpriority=-100)
            config["tempdir"] = tempdir
            return tempdir
    return None


@contextlib.contextmanager
def _nvml_cuda_checks() -> Iterator[None]:
    """Start the forkserver with torch's fork-safe (NVML) CUDA availability check.

    Should anything it preloads ask torch.cuda.is_available(), the CUDA driver must not get
    initialized there: every rank forked from it would inherit a driver it cannot use.
    """
    name = "PYTORCH_NVML_BASED_CUDA_CHECK"
    previous = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _helper_pid(name: str) -> int | None:
    if name == "forkserver":
        return getattr(forkserver._forkserver, "_forkserver_pid", None)
    return getattr(resource_tracker._resource_tracker, "_pid", None)


def stop_helpers() -> None:
    """Stop the forkserver and resource tracker if this runtime started them (they are our children).

    Both exit as soon as their "alive" pipe closes, which is what their `_stop` does.
    """
    helpers = {"forkserver": forkserver._forkserver, "tracker": resource_tracker._resource_tracker}
    _mark_clean_stop()
    for name, helper in helpers.items():
        pid = _owned_helpers.pop(name, None)
        stop = getattr(helper, "_stop", None)
        if pid is not None and pid == _helper_pid(name) and stop is not None:
            _bounded(stop, pid)


def _mark_clean_stop() -> None:
    """Tell our forkserver's exit hook that this is a clean stop: the runner removes its own dirs."""
    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    if _owned_helpers.get("forkserver") is None or not isinstance(address, str) or address[:1] == "\0":
        return
    with contextlib.suppress(OSError):
        open(os.path.join(os.path.dirname(address), lifeline.CLEAN_STOP_MARKER), "w").close()


def _bounded(stop: Callable[[], None], pid: int) -> None:
    """Run a helper's `_stop` (which waits for the helper without a timeout) with a deadline:
    a helper still there after HELPER_STOP_S is killed, which ends that wait."""
    timer = threading.Timer(HELPER_STOP_S, signal_pid, args=(pid, signal.SIGKILL))
    timer.daemon = True
    timer.start()
    try:
        stop()
    finally:
        timer.cancel()


def signal_pid(pid: int, signum: int) -> None:
    """Send `signum` to `pid`, which may be gone already."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
