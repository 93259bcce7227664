"""README's adapter is a complete file, examples/mypkg/adapters.py (and its library test file,
examples/tests/test_fsdp2_gather.py), and both run as README says from a folder outside the checkout:
`qgather run --impl mypkg.adapters:MyImpl` from the folder that holds mypkg/, every printed
`reproduce:` line as printed there, and the plain-pytest route; elsewhere, one line and exit 4."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ADAPTER = EXAMPLES / "mypkg" / "adapters.py"
LIBRARY_TEST = EXAMPLES / "tests" / "test_fsdp2_gather.py"
IMPL = "mypkg.adapters:MyImpl"
# a handful of cases: aligned, uneven and zero-row shards at 2 ranks, gathered and after a step
SELECTION = ["--impl", IMPL, "--world-sizes", "2", "--scenarios", "gather,steps", "-k", "128x64 or 31x128 or 1x16"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m ...` in `cwd` with qgather importable as an install makes it (PYTHONPATH: the source root)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = str(REPO / "harness")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A library's folder outside the checkout: README's files where README puts them."""
    shutil.copytree(EXAMPLES, tmp_path / "adp", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "adp"


def test_readme_shows_the_example_files_as_they_are():
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert ADAPTER.read_text() in blocks, "README's adapter block differs from examples/mypkg/adapters.py"
    assert LIBRARY_TEST.read_text() in blocks, "README's library test differs from examples/tests/test_fsdp2_gather.py"


def test_the_example_adapter_runs_as_readme_says(project: Path):
    run = _run(["-m", "qgather", "run", *SELECTION, "--report-dir", "rep"], project)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = [line for line in run.stdout.splitlines() if line.strip()][-1]
    assert " passed" in last and " in " in last, last  # the run's own -q (no user -q) keeps pytest's final line
    data = json.loads((project / "rep" / "verdicts.json").read_text())
    cases = data["cases"]
    # its skips are its cases': no test of the suite without a case of it is collected as one more skip
    assert data["pytest"]["skipped"] == sum(c["verdict"] == "SKIPPED" for c in cases), data["pytest"]
    assert len(cases) >= 6 and {c["implementation"] for c in cases} == {IMPL}, [c["case"] for c in cases]
    exact = [c for c in cases if c["verdict"] == "EXACT"]
    others = [(c["case"], c["verdict"], c["reason"]) for c in cases if c["verdict"] != "EXACT"]
    # only the FSDP2 configurations the adapter itself leaves out are SKIPPED: never a format, scenario or device
    assert all(v == "SKIPPED" and r.startswith("MyFP8Tensor shards along dim 0 only") for _, v, r in others), others
    assert len(exact) >= 6 and {c["scenario"] for c in exact} == {"gather", "steps"}, [c["case"] for c in exact]
    # a printed reproduce: line runs as printed, in the same shell (here: the same folder)
    repro = shlex.split(cases[0]["repro"])
    assert repro[:2] == ["qgather", "case"], repro
    again = _run(["-m", "qgather", *repro[1:]], project)
    assert again.returncode == 0 and ": EXACT" in again.stdout, again.stdout + again.stderr


STRICTER = """
from mypkg.adapters import MyImpl, MyShardAlignmentError


class NoExperts(MyImpl):
    def make_param(self, fmt, weight):
        if weight.dim() > 2:
            raise MyShardAlignmentError(f"no 3-D weights, got {tuple(weight.shape)}")
        return super().make_param(fmt, weight)


class SkipsExperts(MyImpl):
    def skip_reason(self, spec, device):
        if len(spec.shape) > 2:
            return "mylib holds 2-D weights only"
        return super().skip_reason(spec, device)
"""


def test_the_declared_refusal_is_rejected_and_judged_by_the_policy(project: Path):
    """A refusal raised with the adapter's declared rejection type is REJECTED (not ERROR); on a shape whose
    shards are aligned the policy still wants EXACT, so the case fails, saying so."""
    (project / "mypkg" / "strict.py").write_text(STRICTER)
    # one `qgather case` for both ids (one process, one pool); the exit status is the refusal's failure
    refused, skipped = (f"mypkg.strict:{name}:fp8_tensor:3x1x64:bf16:ws2:gather:s0" for name in ("NoExperts",
                                                                                                 "SkipsExperts"))
    run = _run(["-m", "qgather", "case", refused, skipped], project)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    refusal, skip = run.stdout.split(f"{skipped}: ", 1)
    assert f"{refused}: REJECTED - MyShardAlignmentError: no 3-D weights" in refusal, run.stdout
    assert "expected EXACT (every shard is aligned)" in refusal
    # README's way to leave such shapes out: skip_reason, a SKIPPED with the adapter's reason, not judged (no
    # expectation said; that a SKIPPED alone exits 0 is test_external_world_sizes' skipped-case test)
    assert skip.startswith("SKIPPED - mylib holds 2-D weights only"), run.stdout
    assert "expected" not in skip, run.stdout


def test_the_library_test_file_runs_with_plain_pytest(project: Path):
    run = _run(["-m", "pytest", "tests/test_fsdp2_gather.py", "--device", "cpu", "-p", "no:cacheprovider", "-q",
                "-k", "ws2 and (128x64 or 31x128)"], project)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"\b[4-9] passed", run.stdout), run.stdout[-2000:]


def test_an_adapter_that_cannot_be_imported_is_one_line_and_exit_4(project: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "tests").mkdir(parents=True)
    shutil.copy(LIBRARY_TEST, elsewhere / "tests")
    for args in (["-m", "qgather", "run", "--impl", IMPL],
                 ["-m", "pytest", "tests/test_fsdp2_gather.py", "--device", "cpu", "-p", "no:cacheprovider", "-q"]):
        run = _run(args, elsewhere)
        assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
        lines = [line for line in run.stderr.splitlines() if line.strip()]  # pytest's stdout: "no tests ran"
        assert len(lines) == 1 and "run from the folder that holds mypkg/" in lines[0], lines[:10]
        assert "Traceback" not in run.stdout, run.stdout[-2000:]
    # under xdist a worker cannot stop the session: the module's collection error says it, never a green run
    run = _run(["-m", "pytest", "tests/test_fsdp2_gather.py", "--device", "cpu", "-p", "no:cacheprovider", "-q",
                "-n", "1"], elsewhere)
    assert run.returncode not in (0, 5) and "run from the folder that holds mypkg/" in run.stdout, run.stdout[-2000:]
