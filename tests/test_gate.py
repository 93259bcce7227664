"""A gating run in which an implementation named with --impl had every case skipped tested nothing
of it: the run is red, with the skip reason, not green."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELECT = ["cases/test_alignment.py", "--formats", "fp8_tensor", "--world-sizes", "2", "-p", "no:cacheprovider", "-q",
          "--device", "cpu"]


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", *SELECT, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_an_implementation_with_every_case_skipped_fails_the_run():
    # te runs on CUDA only, so on --device cpu every te case is SKIPPED.
    result = pytest_run("--impl", "reference,te")
    assert result.returncode == 1, result.stdout[-2000:]
    assert "every te case was skipped" in result.stdout and "te does not run on cpu" in result.stdout
    assert "passed" in result.stdout.splitlines()[-1]  # the reference cases themselves passed


def test_the_default_selection_is_not_affected():
    result = pytest_run()
    assert result.returncode == 0, result.stdout[-2000:]
    assert "was skipped" not in result.stdout
