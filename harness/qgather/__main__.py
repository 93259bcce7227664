"""`python -m qgather` and the `qgather` script: the command line (qgather.cli).

From the first line on, Ctrl-C and SIGTERM are recorded rather than raised while the command line loads
(about 0.2 s; over a second on a loaded 2-core host): each is raised again where the command handles it
(qgather.cli.interrupts.release_start_up), so that a `qgather run` interrupted that early still leaves
reports that say incomplete, rather than ending killed by the signal or in a bare traceback.
"""

import atexit
import os
import signal
import sys


def main() -> int:
    received: list[int] = []

    def record(signum, _frame):
        received.append(signum)

    saved = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored (a background job's Ctrl-C) stays ignored
            saved[signum] = signal.signal(signum, record)
    from qgather.cli import main as cli_main
    from qgather.cli.interrupts import hold_start_up

    hold_start_up(received, saved, record)
    rc = cli_main()
    if rc == INTERRUPTED:
        _exit_as_interrupted()
    return rc


INTERRUPTED = 2  # qgather.cli.common.INTERRUPTED (not imported: the start-up imports nothing it need not)


def _exit_as_interrupted() -> None:
    """End an interrupted command with its documented exit code, 2. CPython ends a process by SIGINT at
    exit (-2) once a KeyboardInterrupt has left code run through PyRun_String (pybind11's py::exec, in
    torch's lazy imports) even where qgather caught it and wrote its reports; on a quiet host that was
    one Ctrl-C in two at 1 s into a run. Exit handlers run first (the pools' shutdown among them)."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
