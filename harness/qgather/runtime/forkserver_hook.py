"""Preloaded by the forkserver only: when it exits because its runner died, remove the runner's
temp dirs (its pool dirs, and multiprocessing's pymp-* dir that holds the forkserver socket).

On a clean stop the runner leaves CLEAN_STOP_MARKER beside the socket first and removes its dirs
itself, so this hook touches nothing then. Ranks are forked from the forkserver but leave through
os._exit, so they never run this atexit handler.

The forkserver then leaves through os._exit too: it holds no state of its own to save (its ranks
are gone, it has no process group), and the interpreter's finalization with torch loaded costs it
1.4 s of CPU on the 2-core CI machine, which its runner waits for (qgather.runtime.helpers.stop_helpers)
at the end of every run. The atexit handlers registered before this one (torch's, multiprocessing's)
do not run; those registered after it (a later preload's) ran before it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
from multiprocessing import forkserver

from qgather.runtime.lifeline import CLEAN_STOP_MARKER, remove_pool_dirs_of

_RUNNER_PID = os.getppid()


def _cleanup_and_exit() -> None:
    try:
        _cleanup()
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.flush()
        os._exit(0)


def _cleanup() -> None:
    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    socket_dir = os.path.dirname(address) if isinstance(address, str) and address[:1] != "\0" else ""
    if socket_dir and os.path.exists(os.path.join(socket_dir, CLEAN_STOP_MARKER)):
        return
    remove_pool_dirs_of(_RUNNER_PID)
    if os.path.basename(socket_dir).startswith("pymp-"):
        shutil.rmtree(socket_dir, ignore_errors=True)


if sys.argv[:1] == ["-c"]:  # the forkserver runs as `python -c ...`; never arm this in a runner
    atexit.register(_cleanup_and_exit)
