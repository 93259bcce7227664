"""`pip install .` (not editable) gives a qgather that runs the whole suite and checks the golden
corpus from any directory: the wheel carries the package harness/qgather/ as the import package
qgather (its cases/, and golden/ as qgather/golden_data/), installs no top-level `harness`, and
an installed copy finds them there, with the same case ids as cases/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SELECTION = ["--impl", "reference", "--formats", "fp8_tensor", "--world-sizes", "2"]

# The wheel is built offline with this interpreter's setuptools (bdist_wheel is built in from 70.1).
pytest.importorskip("setuptools", minversion="70.1", reason="building the wheel offline needs setuptools >= 70.1")

# One xdist worker runs the whole module (`make test` uses --dist loadgroup): the wheel is built and installed once.
pytestmark = pytest.mark.xdist_group("install")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the checkout (the build writes build/ and egg-info where it runs)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns(".*", "__pycache__", "build", "dist", "*.egg-info", "reports")
    shutil.copytree(REPO, src, ignore=ignore, dirs_exist_ok=True)
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
         str(out), str(src)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = out.glob("qgather-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return target


def _manifest_files() -> list[str]:
    with open(REPO / "golden" / "manifest.json") as fh:
        return [entry["file"] for entry in json.load(fh)["entries"]]


def test_wheel_carries_every_module_the_suite_and_the_golden_corpus(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    package = REPO / "harness" / "qgather"
    sources = {"qgather/" + p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    assert sources - names == set(), "modules of harness/qgather/ missing from the wheel's qgather/"
    assert not any(n.startswith("harness/") for n in names), "the wheel installs a top-level harness"
    suite = {p.name for p in (REPO / "cases").glob("test_*.py")}
    assert suite and {f"qgather/cases/{n}" for n in suite} <= names, "the packaged suite lacks a case module"
    golden = {p.relative_to(REPO / "golden").as_posix() for p in (REPO / "golden").rglob("*") if p.is_file()}
    packaged = {n.removeprefix("qgather/golden_data/") for n in names if n.startswith("qgather/golden_data/")}
    assert "manifest.json" in packaged and set(_manifest_files()) <= packaged
    assert packaged == golden, "the wheel's golden corpus is not golden/"
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read("qgather/golden_data/manifest.json") == (REPO / "golden" / "manifest.json").read_bytes()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(entry_points).decode()
    assert "qgather = qgather.__main__:main" in text and "qgather = qgather.pytest_plugin" in text


def _run(args: list[str], cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _case_ids(pytest_output: str) -> list[str]:
    from qgather.model.case import CaseSpec, CaseSpecError

    params = [line.split("[", 1)[1].rstrip("]") for line in pytest_output.splitlines() if "::" in line and "[" in line]
    ids = []
    for param in params:  # case ids, not other tests' parameters
        try:
            ids.append(CaseSpec.parse(param).id)
        except CaseSpecError:
            continue
    return sorted(ids)


def test_an_install_runs_the_suite_and_the_golden_check_from_any_directory(
        installed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from qgather.cli import main
    from qgather.paths import suite_dir

    assert Path(suite_dir()) == REPO / "cases"
    assert main(["list", "--cases", *SELECTION]) == 0  # this checkout's cases/
    in_checkout = capsys.readouterr().out
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    probe = _run(["-c", "import qgather, qgather.paths as p; print(qgather.__file__, p.suite_dir(), p.golden_dir())"],
                 elsewhere, installed)
    assert probe.returncode == 0, probe.stderr
    module, suite, golden = probe.stdout.split()
    assert all(Path(p).is_relative_to(installed) for p in (module, suite, golden)), probe.stdout

    listed = _run(["-m", "qgather", "list", "--cases", *SELECTION], elsewhere, installed)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() and listed.stdout == in_checkout
    assert all(":fp8_tensor:" in c and ":ws2:" in c for c in listed.stdout.split())

    collected = _run(["-m", "qgather", "run", *SELECTION, "--collect-only"], elsewhere, installed)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert _case_ids(collected.stdout) == sorted(listed.stdout.split())
    assert "Warning" not in collected.stdout + collected.stderr, collected.stdout[-3000:]

    # plain pytest: the default suite is -m 'not slow'
    pyargs = _run(["-m", "pytest", "--pyargs", "qgather.cases", "--collect-only", "-q", "-p", "no:cacheprovider",
                   "-m", "not slow", *SELECTION], elsewhere, installed)
    assert pyargs.returncode == 0, pyargs.stdout[-3000:] + pyargs.stderr[-3000:]
    assert _case_ids(pyargs.stdout) == sorted(listed.stdout.split())

    checked = _run(["-m", "qgather", "golden", "--check"], elsewhere, installed)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert checked.stdout.strip().splitlines()[-1] == f"golden: {len(_manifest_files())} entries, 0 problems"
    assert list(elsewhere.iterdir()) == [], "the installed harness wrote into the working directory"


def test_an_install_runs_cases_and_the_sweep_from_any_directory(installed: Path, tmp_path: Path):
    """The commands a user reaches for after a failed training run, from an install, outside any checkout.
    One `repro` stands for `case` too: it runs the case through the same engine (qgather.engine.run's
    run_case) and prints the same report, then the environment and the command; what an install could
    lose (the suite, the golden corpus, the package's modules) is the same for both."""
    repro = _run(["-m", "qgather", "repro", "reference:nvfp4_2d:136x64:bf16:ws2:gather:s0", "--device", "cpu"],
                 tmp_path, installed)
    assert repro.returncode == 0 and ": REJECTED - ShardAlignmentError" in repro.stdout, repro.stdout + repro.stderr
    command = [line for line in repro.stdout.splitlines() if line.startswith("reproduce: ")][-1]
    assert " qgather case reference:nvfp4_2d:136x64:bf16:ws2:gather:s0" in command, command
    sweep = _run(["-m", "qgather", "sweep", "--impl", "mutant:nibble_swap", "--format", "nvfp4_2d",
                  "--world-sizes", "1,2", "--max-rows", "34", "--budget-s", "60", "--device", "cpu"],
                 tmp_path, installed)
    assert sweep.returncode == 1 and "SILENT_MISMATCH" in sweep.stdout, sweep.stdout[-3000:] + sweep.stderr[-3000:]


def test_an_install_runs_readme_s_adapter_from_its_folder(installed: Path, tmp_path: Path):
    """README's adapter (examples/) from `pip install .`, as README says: from the folder that holds mypkg/."""
    project = tmp_path / "adp"
    shutil.copytree(REPO / "examples", project, ignore=shutil.ignore_patterns("__pycache__"))
    run = _run(["-m", "qgather", "run", "--impl", "mypkg.adapters:MyImpl", "--world-sizes", "2", "--scenarios",
                "gather", "-k", "128x64 or 31x128", "--report-dir", "rep"], project, installed)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = json.loads((project / "rep" / "verdicts.json").read_text())["cases"]
    assert cases and {c["implementation"] for c in cases} == {"mypkg.adapters:MyImpl"}
    assert any(c["verdict"] == "EXACT" for c in cases)
    assert all(c["verdict"] in ("EXACT", "SKIPPED") and "does not implement" not in c["reason"] for c in cases)
