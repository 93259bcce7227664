"""The bug zoo in `make test`: every mutant gets its expected verdict on its catching case while
the reference passes the same case, and `qgather selftest` reports every mutant caught.

Case reports are memoized per process (`qgather.tools.selftest.run`), so the summary test re-runs only
the cases its xdist worker has not run yet."""

from __future__ import annotations

import pytest

from qgather.impls import available, get_impl
from qgather.impls.mutants import MUTANTS, ZOO, Mutant
from qgather.impls.reference import QuantizedParam
from qgather.model.case import CaseSpec
from qgather.model.policy import expectation
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict
from qgather.tools import selftest

FAILING_VERDICTS = {Verdict.SILENT_MISMATCH, Verdict.RANK_DIVERGENCE, Verdict.DEGRADED, Verdict.ERROR,
                    Verdict.QUANTIZER_MISMATCH, Verdict.HANG, Verdict.CRASH}

# One xdist worker runs the whole module (`make test` uses --dist loadgroup), so that the summary test
# finds every mutant's cases memoized instead of re-running the ones another worker ran.
pytestmark = pytest.mark.xdist_group("selftest")


def test_one_registered_mutant_per_bug_class():
    assert sorted(m.bug_class for m in MUTANTS) == list(range(1, 27))
    names = set(available())
    for mutant in MUTANTS:
        assert mutant.name == f"mutant:{mutant.bug}" and mutant.name in names
        assert isinstance(get_impl(mutant.name), mutant)
        assert mutant.expected in FAILING_VERDICTS, mutant.name
        assert mutant.catching_cases and all(CaseSpec.parse(c).impl == mutant.name for c in mutant.catching_cases)
        assert (mutant.__doc__ or mutant.param_class.__doc__ or "").strip(), f"{mutant.name} says what it models"


def test_every_mutant_is_built_from_one_row_of_the_zoo_table():
    assert [m.spec for m in MUTANTS] == sorted(ZOO, key=lambda spec: spec.bug_class)
    assert len({spec.bug for spec in ZOO}) == len(ZOO)
    for spec, mutant in zip(sorted(ZOO, key=lambda s: s.bug_class), MUTANTS):
        assert (mutant.bug, mutant.bug_class, mutant.expected) == (spec.bug, spec.bug_class, spec.expected)
        assert mutant.verdicts == spec.also | {spec.expected} and mutant.catching_cases == spec.catching_cases
        assert spec.doc and "\n" not in spec.doc and spec.doc in mutant.__doc__
        # the broken behaviour, a parameter class or an adapter's step path, says which real failure it models
        broken = [c for c in (spec.param_class, spec.adapter) if c not in (QuantizedParam, Mutant)]
        assert broken and all((c.__doc__ or "").strip() for c in broken), spec.bug
        assert all(c.__module__.startswith("qgather.impls.mutants.") for c in broken), spec.bug


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.bug)
def test_mutant_is_caught_with_its_verdict(mutant):
    result = selftest.check_mutant(mutant)
    for check in result.checks:
        assert check.report.verdict is mutant.expected, check.report.render()
        assert not check.report.passed, check.report.render()
        assert selftest.reference_passes(check.reference), check.reference.render()
    assert result.caught and result.line().endswith("  caught")


def test_without_the_trim_a_misaligned_1d_gather_fails_after_the_bytes_moved():
    """trim_to_fit is misaligned_shard plus the trim: without it, the mis-sized gather (16 columnwise
    scale blocks for 9) fails the shape check on every rank, but in the post-all-gather hook, after
    the bytes moved: not a refusal, an ERROR (it used to pass as REJECTED)."""
    report = selftest.run("mutant:misaligned_shard:nvfp4_1d:136x64:bf16:ws8:gather:s0")
    assert report.verdict is Verdict.ERROR and not report.passed, report.render()
    assert "columnwise_data" in report.reason and "uint8(72, 64), expected torch.uint8(68, 64)" in report.reason
    assert "post-all-gather hook" in report.reason


def _report(case_id: str, verdict: Verdict) -> CaseReport:
    spec = CaseSpec.parse(case_id)
    return CaseReport(spec, verdict, "", expectation=expectation(spec))


@pytest.mark.parametrize("reference_verdict, mutant_verdict, caught", [
    (Verdict.EXACT, Verdict.SILENT_MISMATCH, True),
    (Verdict.SILENT_MISMATCH, Verdict.SILENT_MISMATCH, False),  # the reference fails the case too
    (Verdict.REJECTED, Verdict.SILENT_MISMATCH, False),  # aligned: a rejection is a failure
    (Verdict.EXACT, Verdict.RANK_DIVERGENCE, False),  # caught, but not named as expected
])
def test_a_catch_needs_the_expected_verdict_and_a_passing_reference(reference_verdict, mutant_verdict, caught):
    case = "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0"
    check = selftest.CaseCheck(case, _report(case, mutant_verdict),
                               _report(selftest.reference_case(case), reference_verdict), Verdict.SILENT_MISMATCH)
    assert check.caught is caught
    assert ("reference fails this case too" in check.reference_line()) is (not check.reference.passed)


def test_selftest_reports_every_mutant_caught(capsys):
    rc = selftest.main(["--keep-pools"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"mutants caught: {len(MUTANTS)}/{len(MUTANTS)}" == "mutants caught: 26/26"
    assert rc == 0
    summary = [line for line in lines if line.startswith("mutant:")]
    assert [line.split()[0] for line in summary] == [m.name for m in MUTANTS]
    assert all(line.endswith("  caught") for line in summary)
