"""`qgather selftest --suite` (mutation mode): the sample, kills, wrong-class verdicts, the summary
line and the exit status. Most tests use fake reports (a monkeypatched `selftest.run`); one runs
two real mutants over their samples."""

from __future__ import annotations

import re

import pytest

from qgather.impls.mutants import FACTORIES, MUTANTS
from qgather.model.case import CaseSpec
from qgather.model.policy import expectation
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict
from qgather.tools import selftest

SUMMARY = re.compile(r"^mutants killed: (\d+)/(\d+), wrong-class verdicts: (\d+), "
                     r"killed by >= 10 cases of the default suite: (\d+)/(\d+)$")


def _report(case_id: str, verdict: Verdict) -> CaseReport:
    spec = CaseSpec.parse(case_id)
    return CaseReport(spec, verdict, "", expectation=expectation(spec))


def _fake(mutant_verdict: Verdict, reference_verdict: Verdict = Verdict.EXACT):
    def run(case_id: str) -> CaseReport:
        impl = CaseSpec.parse(case_id).impl
        return _report(case_id, reference_verdict if impl == "reference" else mutant_verdict)
    return run


def test_sample_is_fixed_and_holds_the_catching_cases():
    for mutant in MUTANTS:
        sample = selftest.suite_sample(mutant)
        assert sample == selftest.suite_sample(mutant) and sample == sorted(set(sample))
        assert set(mutant.catching_cases) <= set(sample)
        assert all(CaseSpec.parse(c).impl == mutant.name for c in sample)


def test_every_mutant_class_set_holds_failing_verdicts_only():
    for mutant in MUTANTS:
        assert mutant.expected in mutant.verdicts
        assert not mutant.verdicts & {Verdict.EXACT, Verdict.REJECTED, Verdict.SKIPPED}, mutant.bug


def test_a_verdict_outside_the_class_set_is_wrong_class():
    nibble = FACTORIES["mutant:nibble_swap"]
    [result] = selftest.run_suite([nibble], runner=_fake(Verdict.DEGRADED))
    assert not result.killed and len(result.wrong_class) == len(selftest.suite_sample(nibble))
    lines, status = selftest.suite_summary([result])
    assert status == 1 and "SURVIVED" in lines[0] and "wrong-class DEGRADED" in lines[0]
    assert SUMMARY.match(lines[-1]).groups() == ("0", "1", str(len(result.wrong_class)), "0", "1")


def test_a_wrong_class_verdict_fails_even_when_every_mutant_is_killed(monkeypatch):
    mutant = FACTORIES["mutant:per_rank_amax"]
    verdicts = {c: Verdict.RANK_DIVERGENCE for c in selftest.suite_sample(mutant)}
    verdicts[selftest.suite_sample(mutant)[0]] = Verdict.ERROR

    def run(case_id):
        return _report(case_id, verdicts.get(case_id, Verdict.EXACT))

    lines, status = selftest.suite_summary(selftest.run_suite([mutant], runner=run))
    assert lines[-1].startswith("mutants killed: 1/1, wrong-class verdicts: 1, ") and status == 1


def test_a_wrong_class_crash_shows_its_evidence():
    mutant = FACTORIES["mutant:per_rank_amax"]
    first = selftest.suite_sample(mutant)[0]
    details = tuple(f"rank 1 stack line {i}" for i in range(20))

    def run(case_id):
        if case_id == first:
            spec = CaseSpec.parse(case_id)
            return CaseReport(spec, Verdict.CRASH, "rank 1 exited with code -9", details, expectation(spec))
        return _report(case_id, Verdict.RANK_DIVERGENCE if case_id.startswith("mutant:") else Verdict.EXACT)

    [result] = selftest.run_suite([mutant], runner=run)
    line = result.line()
    assert f"wrong-class CRASH on {first}" in line
    assert "\n        rank 1 exited with code -9\n        rank 1 stack line 0\n" in line
    assert "rank 1 stack line 10\n" in line and "rank 1 stack line 11" not in line
    assert line.endswith(f"... 9 more lines: qgather case {first}")


def test_kills_outside_the_default_suite_do_not_make_a_mutant_deep():
    """A mutant killed only by sample cases the default run does not hold fails the exit status."""
    nibble = FACTORIES["mutant:nibble_swap"]
    suite = selftest.default_suite_ids()

    def run(case_id):
        spec = CaseSpec.parse(case_id)
        outside = selftest.reference_case(case_id) not in suite
        return _report(case_id, Verdict.SILENT_MISMATCH if spec.impl != "reference" and outside else Verdict.EXACT)

    [result] = selftest.run_suite([nibble], runner=run)
    assert result.suite_kills == 0 and not result.deep
    assert selftest.suite_summary([result])[1] == 1


def test_drawn_cases_are_default_suite_cases_of_the_catching_families():
    suite = selftest.default_suite_ids()
    for name in ("mutant:checkpoint_drops_scale", "mutant:staged_wire", "mutant:per_rank_amax"):
        mutant = FACTORIES[name]
        drawn = selftest.drawn(mutant)
        assert len(drawn) >= selftest.MIN_SUITE_KILLS and set(drawn) <= set(selftest.suite_sample(mutant))
        catching = CaseSpec.parse(mutant.catching_cases[0])
        for case_id in drawn:
            spec = CaseSpec.parse(case_id)
            assert selftest.reference_case(case_id) in suite and spec.fmt == catching.fmt
            if catching.config.token:
                assert spec.config.token, case_id
            else:
                assert spec.scenario == catching.scenario, case_id


def test_a_case_the_reference_fails_counts_neither_as_kill_nor_wrong_class():
    mutant = FACTORIES["mutant:nibble_swap"]
    [result] = selftest.run_suite([mutant], runner=_fake(Verdict.ERROR, Verdict.SILENT_MISMATCH))
    assert not result.killed and not result.wrong_class


def test_a_survived_mutant_makes_the_exit_status_1(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "run", _fake(Verdict.EXACT))
    assert selftest.main(["--suite", "--keep-pools", "nibble_swap"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "SURVIVED" in out[-2] and SUMMARY.match(out[-1]).groups() == ("0", "1", "0", "0", "1")


def test_all_killed_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "run", _fake(Verdict.SILENT_MISMATCH))
    assert selftest.main(["--suite", "--keep-pools", "nibble_swap", "stale_out"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mutation mode: 2 mutants, ")
    assert SUMMARY.match(out[-1]).groups() == ("2", "2", "0", "2", "2")


def test_unknown_option_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        selftest.main(["--suite", "--no-such-option"])
    assert exc.value.code == 2


def test_two_real_mutants_are_killed(capsys):
    """The real engine on the warm pools: nibble_swap (gather) and per_rank_amax (steps)."""
    assert selftest.main(["--suite", "nibble_swap", "per_rank_amax"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out.splitlines()
    assert SUMMARY.match(out[-1]).groups() == ("2", "2", "0", "2", "2")
    assert any(line.startswith("nibble_swap  bug 12  killed by mutant:nibble_swap:") for line in out)


def test_hp_fallback_steps_are_degraded_not_an_adapter_error():
    """The fallback leaves a plain bf16 shard; the optimizer step must update it as such, so the
    steps scenario shows the bug (DEGRADED), not an AttributeError of the mutant's adapter."""
    report = selftest.run("mutant:hp_fallback:nvfp4_2d:128x64:bf16:ws2:steps:s0")
    assert report.verdict is Verdict.DEGRADED, report.render()


def test_scale_padding_injects_its_bug_in_the_gather_not_at_construction():
    import torch

    from qgather.impls import get_impl

    weight = torch.randn(128, 64, dtype=torch.bfloat16)
    built = get_impl("mutant:scale_padding").make_param("nvfp4_2d", weight)
    expected = get_impl("reference").make_param("nvfp4_2d", weight)
    assert built._fmt.name == "nvfp4_2d" and type(built._fmt) is type(expected._fmt)
    assert {n: t.shape for n, t in built._te.items()} == {n: t.shape for n, t in expected._te.items()}
