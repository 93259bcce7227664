"""However the runner dies, nothing it started survives it by more than 5 s: ranks, forkserver,
resource tracker, their ports, and the pool temp dirs.

The runner is a real `python -m qgather case` on a case whose ranks hang in adapter code. The test
waits (bounded) for marker files the hanging ranks write, records the runner's whole process tree,
kills the runner, and polls (bounded) until every recorded process and temp dir is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from qgather.runtime.lifeline import start_time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_CASE = "tests._hang_adapters:HangsInAdapter:nvfp4_2d:128x64:bf16:ws2:gather:s0"
REACH_S = 240.0  # imports, forkserver and pool startup on 2 shared cores
RUNNER_EXIT_S = 30.0  # SIGTERM/SIGINT: the runner's own cleanup
SURVIVAL_S = 5.0

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="walks /proc")


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    return children


def _tree(pid: int) -> set[int]:
    children, found, frontier = _children(), set(), [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _poll(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)  # polling a condition with a deadline, not synchronizing by sleeping


def _alive(pids: dict[int, int | None]) -> list[int]:
    return [pid for pid, started in pids.items() if start_time(pid) is not None and start_time(pid) == started]


def _describe(pids: list[int]) -> list[str]:
    """Each survivor's pid and command line, so a failure says which helper outlived the runner."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{pid}: {command[:160]}")
        except OSError:
            out.append(f"{pid}: (gone)")
    return out


def _socket_dirs(pid: int) -> set[str]:
    """The pymp-* dirs of the Unix sockets `pid` has bound (the forkserver's listener): wherever
    multiprocessing put them, in TMPDIR or, below a deep TMPDIR, in a short dir of its own."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    with open("/proc/net/unix") as f:
        paths = [fields[7] for fields in (line.split() for line in f.readlines()[1:])
                 if len(fields) > 7 and fields[6] in inodes]
    return {os.path.dirname(path) for path in paths if os.path.basename(os.path.dirname(path)).startswith("pymp-")}


def _forkserver(runner: int) -> int | None:
    """The runner's forkserver: its child running multiprocessing.forkserver (the ranks forked from it
    show the same command line, one level further down)."""
    for pid in _children().get(runner, []):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"multiprocessing.forkserver" in fh.read():
                return pid
    return None


def _ours(tmp) -> list[str]:
    """The runner's temp dirs: its pools', and multiprocessing's (the forkserver socket's)."""
    return [name for name in os.listdir(tmp) if name.startswith(("qgather-pool-", "pymp-"))]


@pytest.mark.isolated
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_nothing_outlives_a_killed_runner(tmp_path, signum):
    tmp, marks = tmp_path / "tmp", tmp_path / "marks"
    tmp.mkdir()
    marks.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmp), QGATHER_TEST_MARKER_DIR=str(marks),
               QGATHER_HANG_DETAIL="0")
    runner = subprocess.Popen([sys.executable, "-m", "qgather", "case", HANG_CASE, "--device", "cpu",
                               "--backend", "gloo", "--case-timeout", "600"],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        reached = _poll(lambda: len(os.listdir(marks)) >= 2 or runner.poll() is not None, REACH_S)
        assert reached and runner.poll() is None, runner.communicate(timeout=30)[0].decode()[-3000:]
        ranks = {int(name.rsplit(".", 1)[1]) for name in os.listdir(marks)}
        tree = _tree(runner.pid)
        assert ranks <= tree, (ranks, tree)
        # the forkserver and two ranks at least (multiprocessing starts its resource tracker lazily:
        # a fresh clone's CI run had none at this point)
        assert len(tree) >= 3, tree
        pids = {pid: start_time(pid) for pid in tree}
        assert any(name.startswith("qgather-pool-") for name in _ours(tmp))
        # ranks forked by a forkserver, not spawned (a deep TMPDIR once made it fall back silently)
        server = _forkserver(runner.pid)
        assert server is not None, _describe(sorted(tree))
        socket_dirs = _socket_dirs(server)
        assert socket_dirs, "the forkserver's socket was not found"

        runner.send_signal(signum)
        runner.wait(timeout=RUNNER_EXIT_S)
        assert runner.returncode != 0
        assert _poll(lambda: not _alive(pids), SURVIVAL_S), f"still alive: {_describe(_alive(pids))}"
        assert _poll(lambda: not _ours(tmp), SURVIVAL_S), f"left behind: {_ours(tmp)}"
        assert _poll(lambda: not any(map(os.path.exists, socket_dirs)), SURVIVAL_S), f"left behind: {socket_dirs}"
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=30)
