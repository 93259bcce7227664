"""New formats come from a `qgather.formats` entry point and are known before options are validated."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_entry_point_format_is_listed_and_selectable(tmp_path):
    (tmp_path / "myfmt.py").write_text(
        "from qgather.formats.nvfp4 import Nvfp4_2DFormat\n"
        "class PluginFormat(Nvfp4_2DFormat):\n    name = 'nvfp4_2d_plugin'\n")
    dist = tmp_path / "myfmt-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myfmt\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[qgather.formats]\nnvfp4_2d_plugin = myfmt:PluginFormat\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, str(tmp_path)])}
    listed = subprocess.run([sys.executable, "-m", "qgather", "list", "formats"], capture_output=True, text=True,
                            cwd=REPO, env=env, timeout=300)
    assert listed.returncode == 0, listed.stderr
    assert "nvfp4_2d_plugin      row block 16" in listed.stdout
    cases = subprocess.run([sys.executable, "-m", "qgather", "list", "--cases", "--formats", "nvfp4_2d_plugin",
                            "--world-sizes", "2", "--scenarios", "gather"], capture_output=True, text=True,
                           cwd=REPO, env=env, timeout=300)
    assert cases.returncode == 0, cases.stderr
    assert "reference:nvfp4_2d_plugin:136x64:bf16:ws2:gather:s0" in cases.stdout.split()
