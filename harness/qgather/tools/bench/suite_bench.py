"""Cases per second of the default case suite (`qgather bench suite`, part of `make bench`).

    python -m qgather.tools.bench.suite_bench [pytest options, e.g. --formats nvfp4_2d]

Runs the suite (the default run: the covering design, not --exhaustive) under pytest in a fresh
process with QGATHER_BENCH_WORKERS xdist workers (default 2, as `make test`; 0: no xdist), counts
the cases from the run's verdict JSON and prints `suite: N cases in T s: R cases/s (W workers)`.
Returns pytest's exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from qgather.paths import checkout_root, suite_dir


def main(argv: Sequence[str] | None = None) -> int:
    workers = os.environ.get("QGATHER_BENCH_WORKERS", "2")
    with tempfile.TemporaryDirectory() as tmp:
        verdicts = os.path.join(tmp, "verdicts.json")
        cmd = [sys.executable, "-m", "pytest", suite_dir(), "-q", "-p", "no:cacheprovider",
               "-p", "qgather", "--qgather-json", verdicts,
               *(["-n", workers] if workers != "0" else []), *(argv or [])]
        start = time.perf_counter()
        rc = subprocess.run(cmd, cwd=checkout_root() or tmp, stdout=subprocess.DEVNULL).returncode
        seconds = time.perf_counter() - start
        cases = 0
        if os.path.exists(verdicts):  # absent when nothing ran
            with open(verdicts) as fh:
                cases = len({record["case"] for record in json.load(fh)})
    print(f"suite: {cases} cases in {seconds:.1f} s: {cases / seconds:.1f} cases/s ({workers} workers)")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
