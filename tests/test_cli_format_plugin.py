"""New formats come from a `qgather.formats` entry point and are known before options are validated."""

from __future__ import annotations

import os

from tests._one_process import qgather_mains

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
    (listed, listed_out, listed_err), (cases, cases_out, cases_err) = qgather_mains(
        [["list", "formats"], ["list", "--cases", "--formats", "nvfp4_2d_plugin", "--world-sizes", "2",
                               "--scenarios", "gather"]], cwd=REPO, env=env)
    assert listed == 0, listed_err
    assert "nvfp4_2d_plugin      row block 16" in listed_out
    assert cases == 0, cases_err
    assert "reference:nvfp4_2d_plugin:136x64:bf16:ws2:gather:s0" in cases_out.split()


BROKEN = '''
from rowpkg.format import Fp8RowwiseFormat


class OneScale(Fp8RowwiseFormat):
    name = "fp8_one_scale"

    def buffer_specs(self, shape):  # declares one scale, while its quantize makes one per row
        specs = super().buffer_specs(shape)
        return {**specs, "scale_inv": ((1,), specs["scale_inv"][1])}


class Unnamed(Fp8RowwiseFormat):
    name = "fp8:rows"
'''


def test_a_format_of_your_own_loads_from_the_current_folder_and_keeps_its_rules(tmp_path):
    """`--formats package.module:Class` from the folder that holds the package, as an adapter loads; a format
    whose quantization breaks its declared layout, or whose name a case id cannot carry, is one line, exit 4."""
    import shutil

    shutil.copytree(os.path.join(REPO, "examples", "rowwise", "rowpkg"), tmp_path / "rowpkg")
    (tmp_path / "rowpkg" / "broken.py").write_text(BROKEN)
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "harness")}
    refusals = (("rowpkg.broken:OneScale", "breaks its own rules: quantize made buffers"),
                ("rowpkg.broken:Unnamed", "format name 'fp8:rows' cannot go into a case id"))
    (listed, listed_out, listed_err), *refused = qgather_mains(
        [["list", "formats", "--formats", "rowpkg.format:Fp8RowwiseFormat"],
         *(["list", "formats", "--formats", target] for target, _ in refusals)], cwd=tmp_path, env=env)
    assert listed == 0, listed_err
    assert "fp8_rowwise          row block 1  (from rowpkg.format.Fp8RowwiseFormat)" in listed_out, listed_out
    for (target, says), (rc, out, err) in zip(refusals, refused, strict=True):
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 4 and len(lines) == 1, out + err
        assert lines[0].startswith(f"qgather list: --formats {target!r}: ") and says in lines[0], lines
