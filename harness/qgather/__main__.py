"""`python -m qgather` and the `qgather` script: the command line (qgather.cli).

From the first line on, Ctrl-C and SIGTERM are recorded rather than raised while the command line loads
(about 0.2 s; over a second on a loaded 2-core host): each is raised again where the command handles it
(qgather.cli.interrupts.release_start_up), so that a `qgather run` interrupted that early still leaves
reports that say incomplete, rather than ending killed by the signal or in a bare traceback.
"""

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
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
