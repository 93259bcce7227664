"""Faults across ranks the harness does not own: two tasks started as `srun` would (SLURM_* only,
the meeting point derived from SLURM_LAUNCH_NODE_IPADDR and SLURM_JOB_ID). One rank raising and
one rank dying inside a case end in bounded time, with a non-zero exit on every rank and a report
on rank 0 that names the rank and its host."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import time

import pytest

from qgather.runtime.launch import SLURM_PORT_BASE, SLURM_PORT_SPAN
from qgather.tools.external_demo import REPO, _kill_group, clean_env

BOUND_S = 90.0  # startup + two 3-s cases with their margins, on a loaded 2-core machine


def _free_slurm_job_id() -> str:
    """A job id whose derived MASTER_PORT is free here."""
    for _ in range(50):
        job = random.randrange(1, 10**6)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", SLURM_PORT_BASE + job % SLURM_PORT_SPAN))
            except OSError:
                continue
        return str(job)
    pytest.skip("no free port in the SLURM-derived range")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process groups")
def test_a_rank_that_raises_or_dies_ends_the_job_in_bounded_time_everywhere(tmp_path):
    job = _free_slurm_job_id()
    tasks = []
    start = time.monotonic()
    try:
        for rank in range(2):
            env = clean_env(OMP_NUM_THREADS="1", SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                            SLURM_NTASKS_PER_NODE="2", SLURM_NODEID="0", SLURM_JOB_ID=job, SLURM_STEP_ID="0",
                            SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", SLURM_JOB_NODELIST="localhost", TMPDIR=str(tmp_path))
            out = open(tmp_path / f"rank{rank}.out", "w")
            err = open(tmp_path / f"rank{rank}.err", "w")
            tasks.append(subprocess.Popen(
                [sys.executable, "-m", "pytest", "tests/_external_fault_case.py", "-q", "-p", "no:cacheprovider"],
                cwd=REPO, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True))
        codes = []
        for task in tasks:
            try:
                codes.append(task.wait(timeout=max(1.0, start + BOUND_S - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for task in tasks:
            _kill_group(task)
    seconds = time.monotonic() - start
    out = [(tmp_path / f"rank{r}.out").read_text(errors="replace") for r in range(2)]
    err = [(tmp_path / f"rank{r}.err").read_text(errors="replace") for r in range(2)]
    everything = "\n".join(f"--- rank {r} {name}:\n{text[-3000:]}" for r in range(2)
                           for name, text in (("stdout", out[r]), ("stderr", err[r])))
    assert None not in codes, f"a rank still ran after {BOUND_S} s:\n{everything}"
    assert codes[0] == 1 and codes[1] == 17, f"exit codes {codes}:\n{everything}"
    # the failure bodies' lines only: pytest's short summary repeats them (in full when CI is set)
    faults = re.findall(r"^E\s+AssertionError: QGATHER_FAULT (.*)$", out[0], re.MULTILINE)
    assert len(faults) == 2, everything
    assert faults[0].startswith("rank 1 raised RuntimeError: injected fault on rank 1 (rank 0 was waiting in "
                                "a collective"), faults[0]
    assert faults[1].startswith("CRASH: a rank was lost"), faults[1]
    assert f"rank 1 (job rank 1 on {socket.gethostname()}) sent no report" in faults[1], faults[1]
    assert "2 failed" in out[0] and "not_reached" not in out[0], out[0][-2000:]
    assert out[1].strip() == "", "rank 1 prints no pytest session of its own"
    assert f"job rank 1 on {socket.gethostname()}: case fault:raise: raised RuntimeError: injected fault" in err[1]
    assert seconds < BOUND_S
