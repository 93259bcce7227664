"""Where a case's seconds go: the phase tracker's clock, the engine's per-step seconds and timings.md."""

import itertools

from qgather.engine.run import POOL_START, step_seconds
from qgather.model.case_record import CaseRecord
from qgather.model.phases import Phase, PhaseTracker, Step
from qgather.model.records import RankResult
from qgather.model.verdict import Verdict
from qgather.pytest_plugin.timings import render
from qgather.runtime.outcome import CaseOutcome, OutcomeStatus


def test_clock_charges_each_phase_and_label(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr("qgather.model.phases.time.perf_counter", lambda: float(next(ticks)))
    synced = []
    phases = PhaseTracker(sync=lambda: synced.append(1))  # t=0
    with phases.labelled(Step.GOLDEN):  # lap at 1 (build), 2 (golden), the label spans a phase change
        phases.current = Phase.SHARD  # 2 -> golden 1 s so far
    with phases.at(Phase.COLLECTIVE):  # lap at 4: 1 s of shard
        pass
    got = dict(phases.seconds())  # lap at 5: 1 s of collective
    assert got == {Phase.BUILD.value: 1.0, "golden": 2.0, Phase.SHARD.value: 1.0, Phase.COLLECTIVE.value: 1.0}
    assert len(synced) == 5  # every reading waited for the device first


def test_labelled_block_keeps_the_error_phase():
    phases = PhaseTracker()
    try:
        with phases.tagging(), phases.labelled(Step.GOLDEN):
            phases.current = Phase.INSPECTION
            raise ValueError("x")
    except ValueError as exc:
        assert exc.qgather_phase == Phase.INSPECTION.value


def test_step_seconds_takes_the_slowest_rank_and_the_pool_start():
    results = [RankResult(0, (), seconds=(("golden", 1.0), ("collective", 0.5))),
               RankResult(1, (), seconds=(("golden", 0.25), ("collective", 2.0)))]
    outcome = CaseOutcome(OutcomeStatus.OK, results, startup_s=3.0)
    assert step_seconds(outcome) == ((POOL_START, 3.0), ("golden", 1.0), ("collective", 2.0))
    assert step_seconds(CaseOutcome(OutcomeStatus.OK, results[:1])) == (("golden", 1.0), ("collective", 0.5))


def _record(case: str, seconds: float, steps: dict[str, float]) -> CaseRecord:
    return CaseRecord(case, "reference", "fp8_tensor", 2, "aligned", "gather", "default", "gather cpu/gloo",
                      Verdict.EXACT, True, "", "", "", seconds=seconds, step_seconds=steps)


def test_timings_page_sums_steps_and_lists_the_slowest_first():
    page = render([_record("a", 1.0, {"golden": 0.5, "collective": 0.25}),
                   _record("b", 3.0, {"golden": 1.5, POOL_START: 1.0})])
    assert "2 cases that ran, 4.0 s of case time" in page
    assert "| golden | 2 | 2.00 | 50.0% |" in page
    assert "| (outside the steps: dispatch, skips, evidence) | 2 | 0.75 | 18.8% |" in page
    slowest = page.split("slowest cases")[1]
    assert slowest.index("| b |") < slowest.index("| a |")


def test_step_seconds_survive_the_record_round_trip():
    record = _record("a", 1.0, {"golden": 0.5})
    assert CaseRecord.from_dict(record.to_dict()) == record
