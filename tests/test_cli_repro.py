"""`qgather repro`: the report, the environment, and a command that reruns the case from a fresh shell."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = "reference:nvfp4_2d:64x64:bf16:ws2:gather:s0"
# A configured case: its repro (test_repro_prints_report_environment_and_command) must name it, token and all.
CONFIGURED = "reference:fp8_tensor:128x64:bf16:ws2:gather:s0:mp-bf16"


def qgather(*args: str, pythonpath: str = REPO, cwd: str = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-m", "qgather", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def activated_env() -> dict[str, str]:
    """A fresh shell after README's set-up (`source .venv/bin/activate`): this venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def _reproduce_line(stdout: str) -> str:
    return [line for line in stdout.splitlines() if line.startswith("reproduce: ")][-1][len("reproduce: "):]


def test_repro_prints_report_environment_and_command():
    """On a configured case (its id ends with the configuration token): the command names the configured
    case, not its default-configuration twin. That `qgather case <id>` reruns from a fresh shell is
    test_repro_external_adapter_command_works_from_fresh_shell's rerun (the same command behind its
    PYTHONPATH); that the configured id runs EXACT under `case` is this repro's own run of it."""
    result = qgather("repro", CONFIGURED)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"{CONFIGURED}: EXACT" in out
    for key in ("python: ", "torch: ", "transformer_engine: ", "torchao: ", "gpu: ", "backend: gloo"):
        assert key in out
    command = _reproduce_line(out)
    assert command == f"qgather case {CONFIGURED}"  # the plain command, as every report prints it


def test_repro_external_adapter_command_works_from_fresh_shell(tmp_path):
    pkg = tmp_path / "adapters"
    pkg.mkdir()
    (pkg / "my_adapter.py").write_text(
        "from qgather.impls.reference import ReferenceImplementation\n"
        "class Adapter(ReferenceImplementation):\n    pass\n")
    case = CASE.replace("reference", "my_adapter:Adapter", 1)
    result = qgather("repro", case, pythonpath=os.pathsep.join([REPO, str(pkg)]))
    assert result.returncode == 0, result.stderr
    command = _reproduce_line(result.stdout)
    assert command.startswith("PYTHONPATH=") and str(pkg) in shlex.split(command)[0]
    env = activated_env()
    rerun = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd="/", env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{case}: EXACT" in rerun.stdout


def test_repro_failing_verdict_exits_1():
    result = qgather("repro", "mutant:per_rank_amax:nvfp4_2d:64x64:bf16:ws2:reshard:s0")
    assert result.returncode == 1, result.stdout[-2000:]
    assert "reproduce: " in result.stdout


def test_repro_bad_input_exits_4():
    result = qgather("repro", "reference:nofmt:64x64:bf16:ws2:gather:s0")
    assert result.returncode == 4
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("qgather repro:")
