"""The CPU standalone scripts tell what `qgather case` tells: for each sampled id, `python FILE` (gloo
ranks forked by the script) run with qgather made unimportable (`sys.modules['qgather'] = None`, no
PYTHONPATH) prints the same verdict as qgather's report, with the same counts of differing elements
per buffer, and exits 1 on a failing verdict, 0 on EXACT.

SAMPLE holds failing cases of the default suite that the known-issues baseline lists (torchao: CRASH,
ERROR, SILENT_MISMATCH and HANG), one or more per scenario (gather, steps, reshard, layers, block) and
per configuration token (mp, raf, hsdp, tp, tp-row, compile, dcp, nested), and passing reference cases
across the same scenarios and tokens. The default run checks FAST (about 40 s on 2 cores); `-m slow`
checks all of SAMPLE, and that it still is what it says (in the suite, failing per the baseline)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest

from qgather.model.case import CaseSpec
from qgather.pytest_plugin.baseline import load, match
from qgather.tools.standalone import render

pytestmark = pytest.mark.xdist_group("standalone")  # one qgather run for the ids: one worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG = "torchao:precompute:fp8_tensor:5x64:bf16:ws2:gather:s0"  # docs/findings.md#torchao-uneven-shards
SAMPLE = (
    "torchao:fp8_tensor:1x16:bf16:ws2:gather:s0",  # gather: a rank with no rows
    "torchao:fp8_tensor:128x64:bf16:ws2:steps:s0:tp-1x2",  # steps, tp: each TP piece's own amax
    "torchao:fp8_tensor:46x64:bf16:ws3:reshard:s0",  # reshard: uneven shards
    "torchao:fp8_tensor:17x64:bf16:ws2:layers:s0",  # layers
    "torchao:fp8_tensor:17x64:bf16:ws2:block:s0",  # block
    "torchao:fp8_tensor:17x64:bf16:ws2:block:s0:nested",  # nested
    "torchao:fp8_tensor:1x16:fp32:ws2:steps:s0:mp-bf16+raf-no+hsdp-1x2",  # mp, raf, hsdp
    "torchao:fp8_tensor:16x32:bf16:ws4:gather:s0:tp-2x2-row",  # tp-row
    "torchao:fp8_tensor:1x16:bf16:ws2:gather:s0:compile",  # compile
    "torchao:fp8_tensor:31x128:bf16:ws2:gather:s0:dcp-ws2",  # dcp
    HANG,
    "reference:fp8_tensor:16x64:bf16:ws1:layers:s0",
    "reference:fp8_block:255x64:bf16:ws2:block:s0:nested",
    "reference:fp8_tensor_e5m2:128x64:bf16:ws4:gather:s0:tp-2x2-row",
    "reference:nvfp4_1d:1x2x16:bf16:ws2:gather:s0:compile+dcp-ws4",
    "reference:mxfp8:32x64:fp32:ws2:reshard:s0:mp-bf16-rfp32+raf-no+hsdp-1x2+dim1",
)
FAST = ("torchao:fp8_tensor:128x64:bf16:ws2:steps:s0:tp-1x2", "torchao:fp8_tensor:17x64:bf16:ws2:block:s0",
        "reference:fp8_tensor:16x64:bf16:ws1:layers:s0")
HANG_AFTER_S = "8"  # the hang's deadline, for qgather and the script alike
COUNTS = re.compile(r"\w+: \d+ of \d+ valid elements differ")
NO_QGATHER = "import sys; sys.modules['qgather'] = None; exec(open(sys.argv[1]).read())"


def _headlines(stdout: str, ids: tuple[str, ...]) -> dict[str, str]:
    """case id -> `VERDICT[ - evidence]`, from report lines `ID: VERDICT[ - evidence]`."""
    out = {}
    for line in stdout.splitlines():
        head, sep, rest = line.partition(": ")
        if sep and head in ids and head not in out:
            out[head] = rest
    return out


@functools.cache
def qgather_verdicts(ids: tuple[str, ...]) -> dict[str, str]:
    """`qgather case` of `ids` (one run), each id's headline."""
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "harness")}
    timeout = ("--case-timeout", HANG_AFTER_S) if ids == (HANG,) else ("--case-timeout", "60")
    result = subprocess.run([sys.executable, "-m", "qgather", "case", *ids, *timeout], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=900)
    headlines = _headlines(result.stdout, ids)
    assert sorted(headlines) == sorted(ids), result.stdout + result.stderr
    return headlines


def check_script(case_id: str, qgather_headline: str, tmp_path) -> None:
    """The script, without qgather, tells qgather's verdict and counts, and exits as it should."""
    path = tmp_path / "r.py"
    path.write_text(render(case_id))
    verdict = qgather_headline.split(" - ")[0].strip()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["REPRO_TIMEOUT_S"] = HANG_AFTER_S if case_id == HANG else "120"  # a loaded CI machine is no hang
    result = subprocess.run([sys.executable, "-c", NO_QGATHER, str(path)], capture_output=True, text=True, env=env,
                            cwd=str(tmp_path), timeout=300)
    said = _headlines(result.stdout, (case_id,))
    assert {k: v.split(" - ")[0].strip() for k, v in said.items()} == {case_id: verdict}, (
        result.stdout + result.stderr[-3000:])
    assert result.returncode == (0 if verdict == "EXACT" else 1), result.stdout
    # the same buffers, the same counts of differing elements, as qgather's report headline
    assert set(COUNTS.findall(qgather_headline)) <= set(COUNTS.findall(result.stdout)), result.stdout


@pytest.mark.parametrize("case_id", FAST)
def test_script_gives_qgathers_verdict(case_id, tmp_path):
    check_script(case_id, qgather_verdicts(FAST)[case_id], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", [c for c in SAMPLE if c not in FAST and c != HANG])
def test_every_sampled_script_gives_qgathers_verdict(case_id, tmp_path):
    """`-m slow`: every scenario and configuration token of the sample (about 15 s a case)."""
    ids = tuple(c for c in SAMPLE if c not in FAST and c != HANG)
    check_script(case_id, qgather_verdicts(ids)[case_id], tmp_path)


@pytest.mark.slow
def test_a_hang_is_said_by_the_script_at_its_deadline(tmp_path):
    check_script(HANG, qgather_verdicts((HANG,))[HANG], tmp_path)


def test_sample_covers_every_scenario_and_token_with_failing_cases():
    """Failing torchao cases (per known-issues.toml) in every scenario the scripts cover and under every
    configuration token; passing reference cases (the baseline lists none) beside them."""
    issues = load(os.path.join(REPO, "known-issues.toml"))
    failing = [c for c in SAMPLE if c.startswith("torchao") and c != HANG]  # the hang is a finding's, no suite's
    assert all(match(issues, c) for c in failing) and not any(match(issues, c) for c in SAMPLE if c not in failing)
    assert {CaseSpec.parse(c).scenario for c in failing} == {"gather", "steps", "reshard", "layers", "block"}
    tokens = {t.split("-")[0] for c in failing for t in CaseSpec.parse(c).config.token.split("+") if t}
    assert tokens >= {"mp", "raf", "hsdp", "tp", "compile", "dcp", "nested"}
    assert {CaseSpec.parse(c).scenario for c in SAMPLE if c.startswith("reference")} >= {"gather", "reshard", "layers",
                                                                                          "block"}


@pytest.mark.slow
def test_sample_is_of_the_default_suite():
    from qgather.suite.coverage import suite_cases

    suite = {case.id for impl in ("torchao", "torchao:precompute", "reference")
             for case in suite_cases([impl], named=[impl], memo=True)[0]}
    assert set(SAMPLE) - suite == {HANG}  # docs/findings.md#torchao-uneven-shards


def test_torchrun_runs_the_script_as_it_runs_on_gpus(tmp_path):
    """The torchrun path (what every TE script runs on GPUs), here on gloo: rank 0 prints the verdict
    once, before torchrun stops the other ranks, and the run exits 1 on a failing verdict."""
    case_id = FAST[0]
    path = tmp_path / "r.py"
    path.write_text(render(case_id))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(path)],
                            capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    printed = [line for line in result.stdout.splitlines() if line.startswith(f"{case_id}: ")]
    verdict = qgather_verdicts(FAST)[case_id].split(" - ")[0]
    assert [line.split(" - ")[0] for line in printed] == [f"{case_id}: {verdict}"], (
        result.stdout + result.stderr[-3000:])
    assert result.returncode == 1
