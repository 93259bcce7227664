"""Runs of the case suite that several tests check, each made once (tests/conftest.py's session fixtures):
plain pytest over one module of the suite costs a process's start (torch, the plugin, the collection), which
one run pays for every test that reads it. Each fixture's tests carry its xdist_group, so that under
`--dist loadgroup` one worker makes the run once."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Plain pytest over one module of the suite: the default selection of every implementation, on the CPU.
ALIGNMENT_RUN = ["cases/test_alignment.py", "--formats", "fp8_tensor", "--world-sizes", "2", "-p", "no:cacheprovider",
                 "-q", "--device", "cpu"]
ALIGNMENT_GROUP = "alignment_run"


def run_alignment() -> subprocess.CompletedProcess:
    """`python -m pytest` of ALIGNMENT_RUN in a process of its own, from the checkout (its conftest, its ini)."""
    return subprocess.run([sys.executable, "-m", "pytest", *ALIGNMENT_RUN], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, timeout=300)
