"""The plugin loads through its pytest11 entry point, named `qgather`, and by that name with `-p`
where autoloading is off; nothing registers it twice."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECT = ["cases/test_alignment.py", "--collect-only", "-q", "-p", "no:cacheprovider",
           "--formats", "nvfp4_2d", "--world-sizes", "2"]


def _entry_point_name() -> str:
    with open(os.path.join(REPO, "pyproject.toml")) as fh:  # no tomllib before Python 3.11
        text = fh.read()
    section = text.split("[project.entry-points.pytest11]", 1)[1].split("\n[", 1)[0]
    (name,) = re.findall(r'^"?([\w.]+)"?\s*=\s*"qgather\.pytest_plugin"', section, re.M)
    return name


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    return subprocess.run([sys.executable, "-m", "pytest", *args], capture_output=True, text=True, cwd=REPO,
                          env={**environ, **env}, timeout=300)


def test_the_entry_point_is_named_qgather():
    assert _entry_point_name() == "qgather"


def test_autoloaded_and_named_plugins_collect_the_same_cases():
    autoloaded = _pytest(*COLLECT)
    named = _pytest(*COLLECT, "-p", "qgather", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    both = _pytest(*COLLECT, "-p", "qgather")  # named and autoloaded: registered once
    for result in (autoloaded, named, both):
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert "reference:nvfp4_2d" in result.stdout
    assert autoloaded.stdout.splitlines()[:-1] == named.stdout.splitlines()[:-1] == both.stdout.splitlines()[:-1]


def test_without_the_plugin_the_qgather_options_are_unknown():
    result = _pytest(*COLLECT, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    assert result.returncode == 4 and "--formats" in result.stderr, result.stderr[-2000:]


def test_every_hook_the_plugins_parts_define_is_one_the_plugin_gathers():
    """pytest finds the hooks of the module the entry point names, not of its parts: a part's hook that
    the package does not import is never called (the GPU seats' end-of-summary line once was not)."""
    import importlib
    import inspect
    import pkgutil

    import qgather.pytest_plugin as plugin

    for info in pkgutil.iter_modules(plugin.__path__):
        part = importlib.import_module(f"{plugin.__name__}.{info.name}")
        for name, function in inspect.getmembers(part, inspect.isfunction):
            if name.startswith("pytest_") and function.__module__ == part.__name__:
                assert getattr(plugin, name, None) is function, f"{part.__name__}.{name} is not gathered"
