"""How long `qgather list` and `qgather list --cases` take, each in a fresh process as a user runs them
(`qgather bench list`, part of `make bench`): the goal is 5 s each on a 2-core machine.

    qgather bench list [--reps N]

Prints one line per command, e.g. `list --cases: 3.1 s median of 3 (2.9-3.4 s), 3107 lines; goal 5 s`,
and exits 1 when a command's median misses the goal or the command fails. The time includes the
interpreter's start and every import, which is most of what a listing costs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

GOAL_S = 5.0
COMMANDS = (("list",), ("list", "--cases"))


@dataclass(frozen=True)
class Timing:
    """One command's wall times (seconds, one per repetition), its exit status and output lines."""

    argv: tuple[str, ...]
    seconds: tuple[float, ...]
    returncode: int
    lines: int

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def met(self) -> bool:
        return self.returncode == 0 and self.median <= GOAL_S

    def line(self) -> str:
        spread = f"{min(self.seconds):.1f}-{max(self.seconds):.1f} s"
        status = "" if self.returncode == 0 else f", exit {self.returncode}"
        verdict = "met" if self.met else "MISSED"
        return (f"{' '.join(self.argv)}: {self.median:.1f} s median of {len(self.seconds)} ({spread}), "
                f"{self.lines} lines{status}; goal {GOAL_S:.0f} s {verdict}")


def time_command(argv: Sequence[str], reps: int) -> Timing:
    """Run `python -m qgather ARGV` `reps` times, each in a fresh interpreter; the wall time of each."""
    seconds, rc, lines = [], 0, 0
    for _ in range(reps):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "qgather", *argv], capture_output=True, text=True,
                              timeout=300)
        seconds.append(time.perf_counter() - start)
        rc, lines = rc or done.returncode, len(done.stdout.splitlines())
    return Timing(tuple(argv), tuple(seconds), rc, lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qgather bench list", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, choices=range(1, 11), metavar="N",
                        help="runs of each command (1-10, default 3): the median is compared with the goal")
    args = parser.parse_args(list(argv or ()))
    timings = [time_command(command, args.reps) for command in COMMANDS]
    for timing in timings:
        print(timing.line())
    return 0 if all(t.met for t in timings) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
