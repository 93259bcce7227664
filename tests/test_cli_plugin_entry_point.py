"""The plugin registers through a pytest11 entry point without clashing with conftest.py's pytest_plugins."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entry_point_name() -> str:
    with open(os.path.join(REPO, "pyproject.toml")) as fh:  # no tomllib before Python 3.11
        text = fh.read()
    section = text.split("[project.entry-points.pytest11]", 1)[1].split("\n[", 1)[0]
    (name,) = re.findall(r'^"?([\w.]+)"?\s*=\s*"harness\.pytest_plugin"', section, re.M)
    return name


def test_entry_point_and_conftest_do_not_double_register(tmp_path):
    dist = tmp_path / "qgather_probe-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qgather-probe\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[pytest11]\n{_entry_point_name()} = harness.pytest_plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, str(tmp_path)])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "cases/test_alignment.py", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--formats", "nvfp4_2d", "--world-sizes", "2"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "reference:nvfp4_2d" in result.stdout
