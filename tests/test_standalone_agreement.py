"""The CPU standalone scripts tell what `qgather case` tells: for each sampled id, `python FILE` (gloo
ranks forked by the script) run with qgather made unimportable (`sys.modules['qgather'] = None`, no
PYTHONPATH) prints the same verdict as qgather's report, with the same counts of differing elements
per buffer, and exits 1 on a failing verdict, 0 on EXACT.

SAMPLE holds failing cases of the default suite that the known-issues baseline lists (torchao: CRASH,
ERROR, SILENT_MISMATCH and HANG), one or more per scenario (gather, steps, reshard, layers, block) and
per configuration token (mp, raf, hsdp, tp, tp-row, compile, dcp, nested), and passing reference cases
across the same scenarios and tokens.

BROKEN holds the zoo's mutants (`qgather selftest`'s catching cases) whose bug lives in the parameter
class, the reference adapter otherwise as it is: `qgather repro ID --standalone` refuses a mutant's id
in one line (the zoo is qgather's own code, no library's), so each is scripted as the reference's case
carrying the mutant's class (`render(..., param_class=)`), the reference with a deliberately broken
subclass, and must fail as `qgather case` of the mutant does. Without it no sampled reference script
ever fails, and a reference template that could not fail would go unseen.

The default run checks FAST, BROKEN's first and REJECTED (one qgather run for the five) and the
torchrun paths: 8 tests in 66 s on a shared 2-core machine, of which this file's additions for issue 43
(BROKEN's first script, about 7 s; REJECTED under torchrun and python FILE, about 12 s; their share of
the qgather run, a few seconds) are about 25 s. `-m slow` checks all of SAMPLE and BROKEN (BROKEN's
other eight: 70 s), and that SAMPLE still is what it says (in the suite, failing per the baseline)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest

from qgather.impls.mutants import FACTORIES, Mutant
from qgather.model.case import CaseSpec
from qgather.pytest_plugin.baseline import load, match
from qgather.tools.standalone import UnsupportedCase, render

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
    "torchao:fp8_tensor:31x128:bf16:ws2:gather:s0:dcp-ws2-trained",  # dcp
    HANG,
    "reference:fp8_tensor:16x64:bf16:ws1:layers:s0",
    "reference:fp8_block:255x64:bf16:ws2:block:s0:nested",
    "reference:fp8_tensor_e5m2:128x64:bf16:ws4:gather:s0:tp-2x2-row",
    "reference:nvfp4_1d:1x2x16:bf16:ws2:gather:s0:compile+dcp-ws3",
    "reference:mxfp8:32x64:fp32:ws2:reshard:s0:mp-bf16-rfp32+raf-no+hsdp-1x2+dim1",
)
FAST = ("torchao:fp8_tensor:128x64:bf16:ws2:steps:s0:tp-1x2", "torchao:fp8_tensor:17x64:bf16:ws2:block:s0",
        "reference:fp8_tensor:16x64:bf16:ws1:layers:s0")
BROKEN = (  # each a catching case of its mutant (qgather.impls.mutants.table), one per scenario and token
    "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0",  # gather
    "mutant:no_reshard_stale_layout:fp8_tensor:128x64:bf16:ws2:steps:s0:raf-no",  # steps, raf
    "mutant:stale_out:fp8_tensor:128x64:bf16:ws2:reshard:s0",  # reshard
    "mutant:shared_scale_cache:fp8_tensor:17x64:bf16:ws2:layers:s0",  # layers
    "mutant:staged_wire:fp8_tensor:17x64:bf16:ws2:block:s0",  # block
    "mutant:unflatten_drops_scale:fp8_tensor:128x64:bf16:ws2:gather:s0:compile",  # compile
    "mutant:checkpoint_drops_scale:fp8_tensor:128x64:bf16:ws2:gather:s0:dcp-ws4",  # dcp
    "mutant:assumes_dim0:fp8_tensor:128x64:bf16:ws2:gather:s0:dim1",  # dim1
    "mutant:ignores_param_dtype:nvfp4_2d:128x64:fp32:ws2:gather:s0:mp-bf16",  # mp
)
REJECTED = "reference:nvfp4_2d:20x16:bf16:ws2:gather:s0"  # 10-row shards off nvfp4's 16-row blocks: refused
FAST_RUN = (*FAST, BROKEN[0], REJECTED)  # one qgather run for the default tests
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


def check_script(case_id: str, qgather_headline: str, tmp_path, text: str = "") -> None:
    """The script (`text`, else `render(case_id)`), without qgather, tells qgather's verdict and counts,
    and exits as it should."""
    path = tmp_path / "r.py"
    path.write_text(text or render(case_id))
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
    check_script(case_id, qgather_verdicts(FAST_RUN)[case_id], tmp_path)


def _as_reference(mutant_id: str) -> tuple[str, str]:
    """The reference's case id of a mutant's case, and its script carrying the mutant's parameter class."""
    spec = CaseSpec.parse(mutant_id)
    case_id = mutant_id.replace(f"{spec.impl}:", "reference:", 1)
    return case_id, render(case_id, param_class=FACTORIES[spec.impl].param_class)


def check_broken_reference(mutant_id: str, qgather_headline: str, tmp_path) -> None:
    case_id, text = _as_reference(mutant_id)
    assert not qgather_headline.startswith(("EXACT", "REJECTED")), qgather_headline  # the bug shows in qgather
    check_script(case_id, qgather_headline, tmp_path, text=text)


def test_broken_reference_script_fails_as_qgather_says(tmp_path):
    check_broken_reference(BROKEN[0], qgather_verdicts(FAST_RUN)[BROKEN[0]], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mutant_id", BROKEN[1:])
def test_every_broken_reference_script_fails_as_qgather_says(mutant_id, tmp_path):
    """`-m slow`: a mutant in every scenario and under every token BROKEN names (about 15 s a case)."""
    check_broken_reference(mutant_id, qgather_verdicts(BROKEN[1:])[mutant_id], tmp_path)


def test_broken_sample_is_the_zoos_and_mutants_have_no_script():
    """BROKEN: catching cases of mutants whose adapter is the reference's (their bug in the parameter
    class), across every scenario; their own ids are refused in one line that says why."""
    for mutant_id in BROKEN:
        spec = CaseSpec.parse(mutant_id)
        mutant = FACTORIES[spec.impl]
        assert mutant_id in mutant.catching_cases, mutant_id
        assert mutant.spec.adapter is Mutant, mutant_id  # the reference adapter: only the subclass is broken
        with pytest.raises(UnsupportedCase, match="zoo mutant") as refused:
            render(mutant_id)
        assert len(str(refused.value).splitlines()) == 1
    assert {CaseSpec.parse(m).scenario for m in BROKEN} == {"gather", "steps", "reshard", "layers", "block"}
    with pytest.raises(ValueError, match="the reference's only"):  # a library's script carries no subclass
        render(FAST[0], param_class=FACTORIES[CaseSpec.parse(BROKEN[0]).impl].param_class)


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
    result = _torchrun(render(case_id), 2, tmp_path)
    printed = [line for line in result.stdout.splitlines() if line.startswith(f"{case_id}: ")]
    verdict = qgather_verdicts(FAST_RUN)[case_id].split(" - ")[0]
    assert [line.split(" - ")[0] for line in printed] == [f"{case_id}: {verdict}"], (
        result.stdout + result.stderr[-3000:])
    assert result.returncode == 1


def _torchrun(text: str, ranks: int, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "r.py"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(path)],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)


def test_torchrun_says_rejected_as_python_file_does(tmp_path):
    """Every rank refusing alike before any data moved (the reference's ShardAlignmentError on shards off
    nvfp4's blocks) is REJECTED, exit 0, under torchrun as under python FILE: one line, rank 0's refusal."""
    text = render(REJECTED)
    ran = _torchrun(text, 2, tmp_path)
    forked = subprocess.run([sys.executable, "-c", NO_QGATHER, str(tmp_path / "r.py")], capture_output=True,
                            text=True, cwd=str(tmp_path), timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    for result in (ran, forked):
        printed = [line for line in result.stdout.splitlines() if line.startswith(f"{REJECTED}: ")]
        assert len(printed) == 1 and printed[0].startswith(f"{REJECTED}: REJECTED - ShardAlignmentError: "), (
            result.stdout + result.stderr[-3000:])
        assert result.returncode == 0
    assert _headlines(ran.stdout, (REJECTED,)) == _headlines(forked.stdout, (REJECTED,)) == {
        REJECTED: qgather_verdicts(FAST_RUN)[REJECTED]}
