"""Several commands of qgather's command line in one process of its own: each process a test starts imports torch
(seconds on a loaded 2-core host), where the commands under test need a fresh process, not one each."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence

NEXT = "<<next qgather command>>"


def qgather_mains(argvs: Sequence[Sequence[str]], cwd, env: Mapping[str, str]) -> list[tuple[int, str, str]]:
    """Each argv through qgather's command line (qgather.cli.main, what `python -m qgather` runs), one after the
    other in one process of its own, in `cwd` with `env` (entry points, PYTHONPATH and the current folder read
    as a fresh `qgather` reads them): each command's exit code, stdout and stderr."""
    code = ("import json, sys; from qgather.cli import main\n"
            "def next_command():\n"
            f"    print({NEXT!r}, flush=True); print({NEXT!r}, file=sys.stderr, flush=True)\n"
            "rcs = []\n"
            f"for argv in {[list(argv) for argv in argvs]!r}:\n"
            "    next_command(); rcs.append(main(argv)); sys.stdout.flush(); sys.stderr.flush()\n"
            "next_command(); print(json.dumps(rcs))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=dict(env),
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    *outs, rcs = result.stdout.split(NEXT + "\n")[1:]
    errs = result.stderr.split(NEXT + "\n")[1:-1]
    return list(zip(json.loads(rcs), outs, errs, strict=True))
