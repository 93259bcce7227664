"""make targets and README's exit-code table: GNU make exits 2 for any failed recipe, so every target that
runs qgather (or pytest) names the tool's code on its last line, and .ci/make-rc exits with that code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAKE_RC = REPO / ".ci" / "make-rc"
#: the targets whose recipe runs a qgather command or pytest
TOOL_TARGETS = ("run", "test", "gate-cpu", "test-multigpu", "selftest", "bench", "golden", "repro-docs")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@pytest.fixture
def fake_python(tmp_path) -> Path:
    """An interpreter stand-in that exits with $FAKE_RC: the recipes' plumbing without running anything."""
    path = tmp_path / "python"
    path.write_text('#!/bin/sh\necho "fake python: $*" >&2\nexit "${FAKE_RC:-0}"\n')
    path.chmod(0o755)
    return path


def _make(argv: list[str], code: int = 0, via_make_rc: bool = False, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("QGATHER_RC_FILE", "MAKEFLAGS", "MAKELEVEL")}
    env.update(FAKE_RC=str(code), **extra)
    cmd = [str(MAKE_RC)] if via_make_rc else ["make"]
    return subprocess.run([*cmd, "-s", "-C", str(REPO), *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("target", [t for t in TOOL_TARGETS if t != "test-multigpu"])
@pytest.mark.parametrize("code", [1, 4])
def test_a_failed_target_names_the_tool_s_code_and_make_rc_exits_with_it(fake_python, target, code):
    made = _make([target, f"PY={fake_python}"], code)
    assert made.returncode == 2  # make's own convention, for any failure
    assert f"make: qgather exited {code}" in made.stderr.splitlines(), made.stderr
    assert _make([target, f"PY={fake_python}"], code, via_make_rc=True).returncode == code


def test_a_passing_target_is_0_and_an_empty_test_run_is_1(fake_python):
    assert _make(["run", f"PY={fake_python}"], 0).returncode == 0
    assert _make(["run", f"PY={fake_python}"], 0, via_make_rc=True).returncode == 0
    empty = _make(["test", f"PY={fake_python}"], 5, via_make_rc=True)  # pytest's "no tests collected"
    assert empty.returncode == 1 and "make test: pytest collected no tests" in empty.stderr


def test_make_s_own_failure_keeps_make_s_code():
    result = _make(["no-such-target"], via_make_rc=True)
    assert result.returncode == 2 and "No rule to make target" in result.stderr


def test_the_gpu_target_on_a_host_without_a_gpu_exits_with_gpu_check_s_code():
    import torch  # here only: the other tests of this file drive make through a stand-in, torch unneeded

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the target would run the GPU suite")
    python = f"PY={sys.executable}"
    path = os.environ.get("PYTHONPATH") or str(REPO / "harness")  # importable: the recipe makes no link dir
    made = _make(["test-multigpu", python], PYTHONPATH=path)
    assert made.returncode == 2 and "make: qgather exited 1" in made.stderr, made.stderr
    assert "no GPU found" in made.stderr
    assert _make(["test-multigpu", python], via_make_rc=True, PYTHONPATH=path).returncode == 1


def test_every_tool_target_ends_with_keep_rc():
    """A new target that runs qgather without $(KEEP_RC) would exit make's 2 under .ci/make-rc too."""
    recipes = _recipes((REPO / "Makefile").read_text())
    runs_tool = {t for t, body in recipes.items() if re.search(r"\$\(PY\) -m (qgather|pytest)\b", body)}
    assert runs_tool == set(TOOL_TARGETS)
    for target in TOOL_TARGETS:
        assert recipes[target].rstrip().endswith("$(KEEP_RC)"), target
    # test-torch's tool runs in the `make test` it ends with, which writes the code for it
    assert recipes["test-torch"].rstrip().splitlines()[-1].strip().startswith("$(MAKE) test ")
    # gate-torchao and gate-torch run qgather in a venv of their own, through the `gate` macro, which ends with it
    gate = re.search(r"^define gate\n(.*?)^endef", (REPO / "Makefile").read_text(), re.M | re.S)
    assert gate and gate.group(1).rstrip().endswith("$(KEEP_RC)")
    for target in ("gate-torchao", "gate-torch"):
        assert recipes[target].rstrip().splitlines()[-1].strip().startswith("$(call gate,"), target


@pytest.mark.parametrize("target, variable", [("gate-torchao", "TORCHAO"), ("gate-torch", "TORCH")])
def test_a_version_gate_without_its_version_is_refused_before_any_venv(target, variable):
    made = _make([target, f"{variable}="])  # empty, whatever the environment holds
    assert made.returncode == 2 and f"make {target}: name a" in made.stderr and variable in made.stderr
    assert not list(REPO.glob(".venv-torch*-"))  # no venv named after an empty version


def test_ci_and_readme_s_gpu_job_run_targets_through_make_rc():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.findall(r"^\.ci/make-rc (\S+)", ci, re.M) == ["test", "gate-cpu"]
    assert not re.search(r"^make ", ci, re.M)
    readme = (REPO / "README.md").read_text()
    assert "run: .ci/make-rc test-multigpu PY=python3" in readme


def _recipes(makefile: str) -> dict[str, str]:
    """target -> its recipe's text (tab-indented lines and their continuations)."""
    out: dict[str, str] = {}
    target = None
    for line in makefile.splitlines():
        head = re.match(r"^([A-Za-z][\w-]*):(?!=)", line)
        if head:
            target = head.group(1)
            out[target] = ""
        elif target and (line.startswith("\t") or line.startswith("  ")):
            out[target] += line + "\n"
        elif not line.strip() or line.startswith("#"):
            target = None if not line.strip() else target
    return out
