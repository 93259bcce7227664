"""External launcher mode, for real: two torchrun agents (two "nodes") of two ranks each.

The agents meet through a c10d rendezvous on a free local port, which also numbers the nodes.
Each rank runs pytest on tests/_runtime_external_case.py, whose pool is the launcher's world.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT_TIMEOUT_S = 240.0
RESULT_TAG = "QGATHER_EXTERNAL_RESULT "  # pytest's progress dots may precede it on the line
# Launcher state that must not leak into the agents from an enclosing job (or an xdist worker).
INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
             "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _agent_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED}
    env["TMPDIR"] = str(tmp_path)  # torchelastic leaves its log dirs under TMPDIR
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"))
    return env


def _start_agent(port: int, run_id: str, log_path, tmp_path) -> subprocess.Popen:
    # --redirects 3: each rank's stdout and stderr go to files of their own under --log-dir, so two
    # ranks of one agent never interleave their lines in one log.
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id,
        "--max-restarts", "0", "--log-dir", str(log_path.with_suffix(".ranks")), "--redirects", "3",
        "-m", "pytest", "tests/_runtime_external_case.py", "-q", "-s", "-p", "no:cacheprovider",
    ]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, cwd=REPO, env=_agent_env(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_all(agents: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes, or None for an agent still running at the deadline (then its group is killed)."""
    deadline = time.monotonic() + timeout
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for agent in agents:
        if agent.poll() is None:
            for signum in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(agent.pid, signum)  # the agent's own session: itself and its ranks
                except ProcessLookupError:
                    break
                try:
                    agent.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return codes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs torchrun's c10d rendezvous on Linux")
def test_two_torchrun_agents_share_one_world(tmp_path):
    port, run_id = _free_port(), f"qgather-{uuid.uuid4().hex[:12]}"
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = [_start_agent(port, run_id, log, tmp_path) for log in logs]
    codes = _wait_all(agents, AGENT_TIMEOUT_S)
    rank_logs = sorted(tmp_path.glob("agent*.ranks/**/stdout.log"))
    per_rank = [log.read_text(errors="replace") for log in rank_logs]
    output = "\n".join([*(log.read_text(errors="replace") for log in logs), *per_rank,
                        *(log.read_text(errors="replace") for log in tmp_path.glob("agent*.ranks/**/stderr.log"))])
    assert codes == [0, 0], f"agents exited {codes}:\n{output[-6000:]}"
    assert len(per_rank) == 4, f"one stdout log per rank, found {[str(p) for p in rank_logs]}"

    results = [json.loads(found) for found in re.findall(RESULT_TAG + r"(\{.*\})", output)]
    assert len(results) == 1, f"exactly the reporting rank prints the result:\n{output[-6000:]}"
    slow = results[0].pop("slow")
    assert re.fullmatch(r"HANG after \d+\.\d s: ranks 0,1,2,3 were in overruns_its_timeout "
                        r"\(_runtime_external_case\.py:\d+\)", slow), slow
    assert results[0] == {
        "gather": [0, 1, 2, 3],
        "fsdp2": {"local_rows": 2, "matches": True},
        "reject": "rank 3 raised ValueError: 136 columns are not a multiple of 16",
        "after_error": "ok",
    }
    passed = [len(re.findall(r"\b2 passed\b", text)) for text in per_rank]
    assert passed == [1, 1, 1, 1], f"pytest passed once on every one of the 4 ranks, counted {passed}"
