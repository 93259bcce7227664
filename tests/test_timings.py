"""Where a case's seconds go: the phase tracker's clock, the engine's per-step seconds and timings.md."""

import itertools

from qgather.engine.run import LEASE_WAIT, POOL_START, POOL_START_PHASE, step_seconds
from qgather.model.case_record import CaseRecord
from qgather.model.phases import Phase, PhaseTracker, Step
from qgather.model.records import RankResult
from qgather.model.verdict import Verdict
from qgather.pytest_plugin.timings import render
from qgather.runtime.outcome import CaseOutcome, OutcomeStatus, RankError


class FakeDevice:
    """A DeviceClock whose work for each mark is done at `delays[i]` seconds after the host marked it
    (0 when not given); `reads` counts the waits for it."""

    def __init__(self, now=lambda: 0.0, delays=()) -> None:
        self.now, self.delays, self.marks, self.reads = now, list(delays), [], 0

    def mark(self) -> int:
        self.marks.append(self.now())
        return len(self.marks) - 1

    def done_at(self, marks) -> list[float]:
        self.reads += 1
        return [self.marks[m] + (self.delays[m] if m < len(self.delays) else 0.0) for m in marks]


def test_clock_charges_each_phase_and_label(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr("qgather.model.phases.time.perf_counter", lambda: float(next(ticks)))
    device = FakeDevice()
    phases = PhaseTracker(device=device)  # t=0
    with phases.labelled(Step.GOLDEN):  # lap at 1 (build), 2 (golden), the label spans a phase change
        phases.current = Phase.SHARD  # 2 -> golden 1 s so far
    with phases.at(Phase.COLLECTIVE):  # lap at 4: 1 s of shard
        pass
    got = dict(phases.seconds())  # lap at 5: 1 s of collective
    assert got == {Phase.BUILD.value: 1.0, "golden": 2.0, Phase.SHARD.value: 1.0, Phase.COLLECTIVE.value: 1.0}
    assert len(device.marks) == 5  # every change marked the device's queue
    assert device.reads == 1  # and it was waited for once, when the seconds were asked for


def test_device_work_is_charged_to_the_step_that_queued_it(monkeypatch):
    """The host queues the build (0-1 s) and moves on; the device finishes the build's work at 4 s,
    while the host already ran the shard (1-2 s): the build takes 4 s, the shard starts at 4 s."""
    clock = [0.0]
    monkeypatch.setattr("qgather.model.phases.time.perf_counter", lambda: clock[0])
    walls = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr("qgather.model.phases.time.time", lambda: next(walls))
    device = FakeDevice(now=lambda: clock[0], delays=[3.0, 0.0, 0.5])
    phases = PhaseTracker(device=device)  # build starts at 0 (wall 100)
    clock[0] = 1.0
    phases.current = Phase.SHARD  # build's host part ends at 1, its device work at 4 (wall 101 for the host)
    clock[0] = 2.0
    phases.current = Phase.COLLECTIVE  # shard's host part ends at 2; its device work is done by then
    clock[0] = 5.0
    got = dict(phases.seconds())  # collective: 2-5 on the host, its device work done at 5.5
    assert got == {Phase.BUILD.value: 4.0, Phase.SHARD.value: 0.0, Phase.COLLECTIVE.value: 1.5}
    assert sum(got.values()) == 5.5  # the case's time, host and device together
    started = dict(phases.started())
    assert started == {Phase.BUILD.value: 100.0, Phase.SHARD.value: 104.0, Phase.COLLECTIVE.value: 104.0}


def test_without_a_device_the_clock_is_the_hosts():
    phases = PhaseTracker()
    phases.current = Phase.SHARD
    assert [step for step, _ in phases.seconds()] == [Phase.BUILD.value, Phase.SHARD.value]


def test_clock_notes_when_each_step_first_started(monkeypatch):
    walls = itertools.count(100)
    monkeypatch.setattr("qgather.model.phases.time.time", lambda: float(next(walls)))
    phases = PhaseTracker()  # build starts at 100
    with phases.labelled(Step.GOLDEN):  # 101
        phases.current = Phase.SHARD  # still the golden's time: no new start
    phases.current = Phase.COLLECTIVE  # shard resumed after the label at 102, collective at 103
    phases.current = Phase.SHARD  # already started: its first start stays
    assert dict(phases.started()) == {Phase.BUILD.value: 100.0, "golden": 101.0, Phase.SHARD.value: 102.0,
                                      Phase.COLLECTIVE.value: 103.0}


def test_each_rise_of_the_memory_mark_is_charged_to_the_step_that_raised_it():
    marks = iter([10, 30, 35, 20, 30, 50, 40, 60])  # one reading per lap; 20, 30 and 40 raise nothing
    phases = PhaseTracker(device=FakeDevice(), memory=lambda: next(marks))
    with phases.labelled(Step.GOLDEN):  # build 10; golden 30, then 35 (the label spans a phase change)
        phases.current = Phase.SHARD
    phases.current = Phase.COLLECTIVE  # shard after the label: 20
    phases.current = Phase.SHARD  # collective: 30
    phases.current = Phase.INSPECTION  # shard again: 50
    phases.current = Phase.SHARD  # inspection: 40
    phases.seconds()  # shard: 60
    assert phases.high_water() == ((Phase.BUILD.value, 10), ("golden", 35), (Phase.SHARD.value, 60))


def test_the_memory_mark_is_read_only_on_laps_that_mark_the_device():
    readings = []
    phases = PhaseTracker(memory=lambda: readings.append(1) or 5)  # no device: nothing read
    phases.current = Phase.SHARD
    assert phases.high_water() == () and readings == []
    device = FakeDevice()
    phases = PhaseTracker(device=device, memory=lambda: readings.append(1) or 5)
    phases.seconds(sync=False)  # an error's lap
    assert phases.high_water() == () and readings == [] and device.marks == [] and device.reads == 0
    assert PhaseTracker(device=FakeDevice()).high_water() == ()  # no memory reader


def test_reading_the_memory_mark_is_charged_to_no_step(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("qgather.model.phases.time.perf_counter", lambda: clock[0])

    def reading() -> int:  # the reader's own cost: 10 s on the fake clock
        clock[0] += 10.0
        return 1

    phases = PhaseTracker(device=FakeDevice(), memory=reading)
    clock[0] += 1.0
    phases.current = Phase.SHARD  # build: 1 s, then the reading
    clock[0] += 2.0
    got = dict(phases.seconds())  # shard: 2 s, then the reading
    assert got == {Phase.BUILD.value: 1.0, Phase.SHARD.value: 2.0}


def test_labelled_block_keeps_the_error_phase():
    phases = PhaseTracker()
    try:
        with phases.tagging(), phases.labelled(Step.GOLDEN):
            phases.current = Phase.INSPECTION
            raise ValueError("x")
    except ValueError as exc:
        assert exc.qgather_phase == Phase.INSPECTION.value


def test_an_error_carries_the_steps_until_it_without_waiting_for_the_device(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr("qgather.model.phases.time.perf_counter", lambda: float(next(ticks)))
    device = FakeDevice(delays=[10.0])  # the build's device work would end late: not asked for
    phases = PhaseTracker(device=device)  # t=0
    try:
        with phases.tagging(), phases.labelled(Step.GOLDEN):  # lap at 1 (build)
            raise RuntimeError("CUDA error: an illegal memory access")  # lap at 2 (golden), 3 (build again)
    except RuntimeError as exc:
        error = RankError.from_exception(1, exc)
    assert len(device.marks) == 1 and device.reads == 0  # only the lap before the block marked; none read
    assert dict(error.seconds) == {Phase.BUILD.value: 2.0, "golden": 1.0}


def test_a_rank_that_raised_counts_in_the_step_seconds():
    results = [RankResult(0, (), seconds=(("golden", 1.0),)), None]
    error = RankError(1, "ValueError", "x", seconds=(("golden", 2.0), ("post-all-gather hook", 0.5)))
    outcome = CaseOutcome(OutcomeStatus.ERROR, results, errors={1: error})
    assert step_seconds(outcome) == (("golden", 2.0), ("post-all-gather hook", 0.5))


def test_a_failing_case_reports_its_steps():
    """A case refused in its post-all-gather hook still says where its seconds went."""
    from qgather.engine.run import RunOptions, run_case
    from qgather.model.case import CaseSpec

    spec = CaseSpec.parse("reference:nvfp4_2d:18x64:bf16:ws2:gather:s0")
    report = run_case(spec, RunOptions(backend="gloo", device="cpu"))
    assert report.verdict is Verdict.REJECTED, report.render()
    assert {"golden", "sharded module"} <= dict(report.seconds).keys(), report.seconds


def test_step_seconds_takes_the_slowest_rank_and_the_pool_start():
    """Rank 1 waited 0.75 s in the collective for rank 0's golden: the case took 2.25 s, not 3."""
    results = [RankResult(0, (), seconds=(("golden", 1.0), ("collective", 0.5))),
               RankResult(1, (), seconds=(("golden", 0.25), ("collective", 2.0)))]
    outcome = CaseOutcome(OutcomeStatus.OK, results, startup_s=3.0)
    assert step_seconds(outcome) == ((POOL_START, 3.0), ("golden", 0.25), ("collective", 2.0))
    assert step_seconds(CaseOutcome(OutcomeStatus.OK, results[:1])) == (("golden", 1.0), ("collective", 0.5))
    leased = CaseOutcome(OutcomeStatus.OK, results[:1], startup_s=3.0, lease_wait_s=2.5)  # an NCCL pool's GPUs
    assert step_seconds(leased) == ((LEASE_WAIT, 2.5), (POOL_START, 0.5), ("golden", 1.0), ("collective", 0.5))


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


def test_a_pool_starts_phases_are_its_breakdown_not_steps_of_their_own():
    started = CaseOutcome(OutcomeStatus.OK, [RankResult(0, (), seconds=(("golden", 1.0),))], startup_s=3.0,
                          startup_phases=(("spawn", 0.5), ("rank: CUDA context", 2.0)))
    steps = dict(step_seconds(started))
    assert steps[POOL_START] == 3.0 and steps[POOL_START_PHASE + "rank: CUDA context"] == 2.0
    page = render([_record("a", 4.0, steps), _record("b", 5.0, {POOL_START: 4.0, POOL_START_PHASE + "spawn": 1.5})])
    assert "| pool start | 2 | 7.00 | 77.8% |" in page
    assert "| (outside the steps: dispatch, skips, evidence) | 2 | 1.00 | 11.1% |" in page  # phases not counted twice
    phases = page.split("Pool starts, phase by phase (2 starts)")[1].split("slowest cases")[0]
    assert "| spawn | 2.00 | 1.00 |" in phases and "| rank: CUDA context | 2.00 | 1.00 |" in phases
    assert "spawn" not in page.split("slowest cases")[1]


def test_a_gpu_runs_page_states_its_lease_wait_and_pool_start_even_when_none_waited():
    from dataclasses import replace

    on_gpu = replace(_record("a", 2.0, {"golden": 0.5}), ran_on="nccl/cuda")
    page = render([on_gpu, _record("b", 2.0, {"golden": 0.5})])
    assert "| GPU lease wait | 0 | 0.00 | 0.0% |" in page and "| pool start | 0 | 0.00 | 0.0% |" in page
    assert "lease wait" not in render([_record("b", 2.0, {"golden": 0.5})])  # a CPU run has no GPU budgets
    waited = replace(on_gpu, step_seconds={LEASE_WAIT: 1.0, "golden": 0.5})
    assert "| GPU lease wait | 1 | 1.00 | 25.0% |" in render([waited, _record("b", 2.0, {})])


def test_step_seconds_survive_the_record_round_trip():
    record = _record("a", 1.0, {"golden": 0.5})
    assert CaseRecord.from_dict(record.to_dict()) == record



def test_fsdp2s_reshard_is_a_step_of_its_own():
    """The library's reshard after the first inspection is not charged to the inspection (qgather's
    own, held to its HBM floor by bench gpu)."""
    from qgather.engine.run import RunOptions, run_case
    from qgather.model.case import CaseSpec

    report = run_case(CaseSpec.parse("reference:fp8_tensor:64x64:bf16:ws2:gather:s0"),
                      RunOptions(backend="gloo", device="cpu"))
    assert report.verdict is Verdict.EXACT, report.render()
    assert {Step.RESHARD.value, Phase.INSPECTION.value} <= dict(report.seconds).keys(), report.seconds


def test_a_dcp_cases_save_counts_its_pool_start_and_its_steps_as_one():
    """A dcp-wsA case saves on a pool of A ranks first: that pool's start is the case's pool start too
    (on the 1 x H200 gate a cold save pool cost a dcp case ~10-20 s that timings.md counted nowhere),
    the save's steps one step, and the case's own steps added to them."""
    from qgather.engine.run import SAVE_STEP, added, save_seconds

    rank = RankResult(0, (), seconds=(("build/quantize", 1.0), ("checkpoint save", 2.0)))
    saving = CaseOutcome(OutcomeStatus.OK, [rank], startup_s=4.0, startup_phases=(("spawn", 1.0),))
    assert save_seconds(saving) == ((POOL_START, 4.0), (f"{POOL_START}: spawn", 1.0), (SAVE_STEP, 3.0))
    case = ((POOL_START, 2.0), ("golden", 1.0))
    assert dict(added(save_seconds(saving), case)) == {POOL_START: 6.0, f"{POOL_START}: spawn": 1.0,
                                                      SAVE_STEP: 3.0, "golden": 1.0}
