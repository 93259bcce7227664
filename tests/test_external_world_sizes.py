"""Under a launcher (torchrun/SLURM), a case whose world size the launched job does not have is
SKIPPED with the reason on every rank, not a pytest error (a first step of issue 13's sub-groups)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_world_size_the_job_lacks_is_skipped_with_the_reason():
    env = {**os.environ, "PYTHONPATH": REPO, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    result = subprocess.run([sys.executable, "-m", "qgather", "case", "reference:fp8_tensor:128x64:bf16:ws2:gather:s0",
                             "--device", "cpu"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "reference:fp8_tensor:128x64:bf16:ws2:gather:s0: SKIPPED" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_under_a_launcher_the_default_world_sizes_are_the_jobs():
    """1, 2, 4, ... up to the job's size, plus the job's size (collection only: no rank meets)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SLURM_"))}
    env.update(PYTHONPATH=REPO, RANK="0", WORLD_SIZE="6", LOCAL_RANK="0", TORCHELASTIC_RUN_ID="x")
    result = subprocess.run([sys.executable, "-m", "pytest", "cases/test_scenarios.py", "--collect-only", "-q",
                             "-p", "no:cacheprovider", "--formats", "fp8_tensor"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    sizes = {int(size) for size in re.findall(r":ws(\d+):", result.stdout)}
    assert sizes == {1, 2, 4, 6}, result.stdout[-2000:]
