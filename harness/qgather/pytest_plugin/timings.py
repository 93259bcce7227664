"""Where a run's seconds went (timings.md in the report directory): the cases' steps summed over the
run (pool starts, the one-device twin, the golden, building the sharded module, the hooks and the
collective, the inspection ...), then the slowest cases step by step. A run with cases on GPUs always
shows the GPU lease wait and the pool start, 0 where no case waited for either (a GPU job's budgets
are read off them). The numbers are the CaseRecords' `step_seconds` (qgather.engine.run.step_seconds),
which verdicts.json holds too."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from qgather.engine.run import LEASE_WAIT, POOL_START, POOL_START_PHASE
from qgather.model.case_record import CaseRecord

SLOWEST_SHOWN = 25


def render(records: Iterable[CaseRecord], slowest: int = SLOWEST_SHOWN) -> str:
    """The Markdown page: totals per step, then the `slowest` cases with their steps."""
    ran = [r for r in records if r.seconds or r.step_seconds]
    totals: Counter = Counter()
    cases_with: Counter = Counter()
    phases: Counter = Counter()  # the pool starts' phases: a breakdown of "pool start", shown apart
    for record in ran:
        for step, seconds in record.step_seconds.items():
            if step.startswith(POOL_START_PHASE):
                phases[step.removeprefix(POOL_START_PHASE)] += seconds
                continue
            totals[step] += seconds
            cases_with[step] += 1
    wall = sum(r.seconds for r in ran)
    out = [f"# qgather timings: {len(ran)} cases that ran, {wall:.1f} s of case time", "",
           "| step | cases | seconds | share of case time |", "| --- | ---: | ---: | ---: |"]
    if any(r.ran_on.endswith("/cuda") for r in ran):  # a GPU run's budgets, stated even where nothing waited
        totals.update({LEASE_WAIT: 0.0, POOL_START: 0.0})
    for step, seconds in totals.most_common():
        share = f"{100 * seconds / wall:.1f}%" if wall else "-"
        out.append(f"| {step} | {cases_with[step]} | {seconds:.2f} | {share} |")
    unmeasured = wall - sum(totals.values())
    out.append(f"| (outside the steps: dispatch, skips, evidence) | {len(ran)} | {unmeasured:.2f} | "
               f"{100 * unmeasured / wall:.1f}% |" if wall else "| (outside the steps) | 0 | 0 | - |")
    out += _start_phases(phases, cases_with[POOL_START_PHASE.removesuffix(": ")])
    out += ["", f"## The {min(slowest, len(ran))} slowest cases", "",
            "| case | verdict | seconds | steps |", "| --- | --- | ---: | --- |"]
    for record in sorted(ran, key=lambda r: -r.seconds)[:slowest]:
        steps = ", ".join(f"{step} {seconds:.2f}" for step, seconds in
                          sorted(_steps(record), key=lambda kv: -kv[1])[:5])
        out.append(f"| {record.case} | {record.verdict.value} | {record.seconds:.2f} | {steps} |")
    return "\n".join(out) + "\n"


def _steps(record: CaseRecord) -> list[tuple[str, float]]:
    return [(step, s) for step, s in record.step_seconds.items() if not step.startswith(POOL_START_PHASE)]


def _start_phases(phases: Counter, starts: int) -> list[str]:
    """The pool starts' seconds phase by phase, summed over the starts (the ranks' phases as long as the
    slowest rank of each start took: they run inside "ranks starting")."""
    if not phases:
        return []
    out = ["", f"## Pool starts, phase by phase ({starts} starts)", "", "| phase | seconds | per start |",
           "| --- | ---: | ---: |"]
    out += [f"| {phase} | {seconds:.2f} | {seconds / starts:.2f} |" for phase, seconds in phases.items()]
    return out
