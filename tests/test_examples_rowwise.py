"""README's second example, examples/rowwise/ (a format of one's own: FP8 with one scale per row, its
subclass and adapter, a library test file), run as README says from a folder outside the checkout, and
copies of it that must fail: a quantizer that differs from its format (QUANTIZER_MISMATCH), a post-hook
that reads the wrong scales (SILENT_MISMATCH), an adapter claiming a format its tensors do not have
(an ERROR that says so, not a broken all-gather). About 40 s on 2 cores: three processes, each a
handful of cases at 2 ranks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_examples import REPO, _run  # the same way of running a command from outside the checkout

EXAMPLE = REPO / "examples" / "rowwise"
IMPL = "rowpkg.adapter:RowwiseImpl"
# uneven (31 rows at 2 ranks: a padded last shard), even, a zero-row rank, a 3-D expert weight; at README's
# world sizes, 1 included, and HSDP's shard groups of one rank (FSDP2's world-size-1 path: one input only)
SELECTION = ["--impl", IMPL, "--world-sizes", "1,2", "--scenarios", "gather,steps", "-k",
             "(test_alignment or test_scenarios) and (31x128 or 128x64 or 1x16 or 3x1x64) or hsdp-2x1"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A library's folder outside the checkout, with the example's files where README puts them."""
    shutil.copytree(EXAMPLE, tmp_path / "lib", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "lib"


def test_readme_points_to_the_rowwise_example():
    readme = (REPO / "README.md").read_text()
    for path in ("examples/rowwise/rowpkg/format.py", "examples/rowwise/rowpkg/tensor.py",
                 "examples/rowwise/rowpkg/adapter.py", "examples/rowwise/tests/test_rowwise_gather.py"):
        assert path in readme and (REPO / path).is_file(), path
    assert f"qgather run --impl {IMPL}" in readme


def test_the_rowwise_format_runs_exact_as_readme_says(project: Path):
    run = _run(["-m", "qgather", "run", *SELECTION, "--report-dir", "rep"], project)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = json.loads((project / "rep" / "verdicts.json").read_text())["cases"]
    exact = [c["case"] for c in cases if c["verdict"] == "EXACT"]
    others = [(c["case"], c["verdict"], c["reason"]) for c in cases if c["verdict"] != "EXACT"]
    # every shard of a one-scale-per-row format is aligned: the policy wants EXACT for every case it runs
    skipped = "RowwiseFP8Tensor shards along dim 0 only"
    assert all(v == "SKIPPED" and r.startswith(skipped) for _, v, r in others), others
    shapes = {c.split(":")[3] for c in exact}
    assert {"31x128", "128x64", "1x16", "3x1x64"} <= shapes and all(":fp8_rowwise:" in c for c in exact), exact
    assert {c.split(":")[6] for c in exact} == {"gather", "steps"}, exact
    assert {c.split(":")[5] for c in exact} == {"ws1", "ws2"} and any("hsdp-2x1" in c for c in exact), exact


VARIANTS = """
from rowpkg.adapter import RowwiseImpl


class ClaimsTensorwise(RowwiseImpl):
    formats = ("fp8_tensor",)           # a format its tensors do not have (one scale, not one per row)

    def own_quantization(self, fmt, weight):
        return None
"""


def _variant(project: Path, package: str, old: str, new: str) -> None:
    """A copy of rowpkg's library and adapter as `package`, its tensor.py with `old` replaced by `new`."""
    (project / package).mkdir()
    (project / package / "__init__.py").write_text('"""A broken copy of rowpkg."""\n')
    adapter = (project / "rowpkg" / "adapter.py").read_text().replace("from rowpkg.tensor", f"from {package}.tensor")
    (project / package / "adapter.py").write_text(adapter)
    tensor = (project / "rowpkg" / "tensor.py").read_text()
    assert tensor.count(old) == 1, old
    (project / package / "tensor.py").write_text(tensor.replace(old, new))


def test_broken_copies_get_the_verdict_of_their_bug(project: Path):
    _variant(project, "rowquant", "    scale = FP8_MAX / row_amax\n",
             "    scale = torch.exp2(torch.floor(torch.log2(FP8_MAX / row_amax)))  # not the format's scales\n")
    _variant(project, "rowpost", "[: rows_of(kept.shape), :4]", "[-rows_of(kept.shape):, :4]")
    (project / "rowpkg" / "claims.py").write_text(VARIANTS)
    ids = ["rowquant.adapter:RowwiseImpl:fp8_rowwise:31x128:bf16:ws2:gather:s0",
           "rowpost.adapter:RowwiseImpl:fp8_rowwise:31x128:bf16:ws2:gather:s0",
           "rowpkg.claims:ClaimsTensorwise:fp8_tensor:128x64:bf16:ws2:gather:s0"]
    run = _run(["-m", "qgather", "case", *ids], project)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    verdicts = dict(re.findall(r"^(\S+): ([A-Z_]+)", run.stdout, re.M))
    assert verdicts[ids[0]] == "QUANTIZER_MISMATCH", run.stdout
    assert verdicts[ids[1]] in ("SILENT_MISMATCH", "RANK_DIVERGENCE"), run.stdout
    # the claimed format is said to be the wrong one: no mismatch of a gather that did nothing wrong
    assert verdicts[ids[2]] == "ERROR", run.stdout
    assert ("rowlib claims format fp8_tensor, but its quantized weight is not of that format: "
            "scale_inv float32(128,) where fp8_tensor has float32(1,)") in run.stdout, run.stdout


def test_the_rowwise_library_test_file_runs_with_plain_pytest(project: Path):
    run = _run(["-m", "pytest", "tests/test_rowwise_gather.py", "--device", "cpu", "-p", "no:cacheprovider", "-q",
                "-k", "(31x128 or 3x1x64) and gather"], project)  # at world sizes 1 and 2
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"\b([4-9]|\d\d) passed", run.stdout), run.stdout[-2000:]
