"""The import layers (pyproject.toml's [tool.importlinter] contract) hold in this checkout, `make lint`
fails on an upward import, no `importlib` call detours around the contract, and README's Layout
names the layers the contract checks. CI runs `make test`, not `make lint`: these tests are how CI
checks the contract."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "harness", "qgather")
# What `make lint` reads and runs: the checkout minus everything that is not source.
LINTED = ("Makefile", "pyproject.toml", "setup.py", "conftest.py", "harness", "tests", "cases")
# Every module of the package that imports by a name computed at run time, each one outside the
# contract's sight by design: a user-named adapter (the one exception the contract allows), a
# third-party module, a directory.
IMPORTLIB_ALLOWED = {
    "paths.py": "loads a user's module: an adapter (--impl package.module:object) or a format of its own",
    "model/repro.py": "finds the import root of qgather and of a user's adapter for a standalone repro",
    "suite/modules.py": "loads the suite's directory (cases/) by path, as pytest collects it",
    "cli/gpu.py": "asks optional third-party libraries for their versions",
    "impls/te/route.py": "TransformerEngine's compiled extension",
    "runtime/helpers.py": "the forkserver's preload list (QGATHER_FORKSERVER_PRELOAD): modules to try, by name",
    "tools/standalone/bundle.py": "reads the source of the zoo modules a standalone script carries",
    "tools/standalone/pieces/reference.py": "runs inside a standalone script: the parameter class it carries",
}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _contract_layers() -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        contracts = tomllib.load(fh)["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["id"] == "layers")["layers"]


def _make_lint(checkout: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", checkout, "lint", f"PY={sys.executable}"], capture_output=True,
                          text=True, timeout=300)


def test_the_checkout_keeps_every_import_contract():
    result = _make_lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout), result.stdout


def test_make_lint_fails_on_an_upward_import_even_a_deferred_one(tmp_path):
    for name in LINTED:
        source, target = os.path.join(ROOT, name), tmp_path / name
        if os.path.isdir(source):
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, target)
    base = tmp_path / "harness" / "qgather" / "impls" / "base.py"
    with open(base, "a") as fh:  # an adapter reaching up into the scenarios, hidden in a function
        fh.write("\n\ndef _upward():\n    from qgather.scenarios import registry\n\n    return registry\n")
    result = _make_lint(str(tmp_path))
    assert result.returncode != 0, result.stdout
    assert "qgather.impls.base -> qgather.scenarios.registry" in result.stdout, result.stdout
    assert "BROKEN" in result.stdout


def test_no_importlib_call_detours_around_the_contract():
    users = set()
    for folder, _dirs, files in os.walk(PACKAGE):
        for filename in files:
            path = os.path.join(folder, filename)
            if filename.endswith(".py") and re.search(r"\b(import_module|spec_from_file_location|__import__)\(",
                                                      open(path).read()):
                users.add(os.path.relpath(path, PACKAGE).replace(os.sep, "/"))
    assert users == set(IMPORTLIB_ALLOWED), (
        f"new importlib users {sorted(users - set(IMPORTLIB_ALLOWED))}: import what the package needs "
        "(deferred if it must be), so that the layer contract sees it")


def test_every_package_folder_is_a_layer_of_the_contract():
    named = {part.strip() for layer in _contract_layers() for part in layer.split("|")}
    on_disk = {name.removesuffix(".py") for name in os.listdir(PACKAGE)
               if name != "__init__.py" and (name.endswith(".py") or os.path.isfile(os.path.join(PACKAGE, name,
                                                                                                   "__init__.py")))}
    assert named == on_disk


def test_readmes_layout_lists_the_contracts_layers():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"<!-- layers: pyproject.toml \[tool.importlinter\] -->\n```\n(.*?)```", readme, re.S)
    assert block, "README's Layout lost its layers block"
    shown = [line.split("  ")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert shown == [" | ".join(part.strip() for part in layer.split("|")) for layer in _contract_layers()]
