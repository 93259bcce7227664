"""Where a run's seconds went (timings.md in the report directory): the cases' steps summed over the
run (pool starts, the one-device twin, the golden, building the sharded module, the hooks and the
collective, the inspection ...), then the slowest cases step by step. The numbers are the
CaseRecords' `step_seconds` (qgather.engine.run.step_seconds), which verdicts.json holds too."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from qgather.model.case_record import CaseRecord

SLOWEST_SHOWN = 25


def render(records: Iterable[CaseRecord], slowest: int = SLOWEST_SHOWN) -> str:
    """The Markdown page: totals per step, then the `slowest` cases with their steps."""
    ran = [r for r in records if r.seconds or r.step_seconds]
    totals: Counter = Counter()
    cases_with: Counter = Counter()
    for record in ran:
        for step, seconds in record.step_seconds.items():
            totals[step] += seconds
            cases_with[step] += 1
    wall = sum(r.seconds for r in ran)
    out = [f"# qgather timings: {len(ran)} cases that ran, {wall:.1f} s of case time", "",
           "| step | cases | seconds | share of case time |", "| --- | ---: | ---: | ---: |"]
    for step, seconds in totals.most_common():
        share = f"{100 * seconds / wall:.1f}%" if wall else "-"
        out.append(f"| {step} | {cases_with[step]} | {seconds:.2f} | {share} |")
    unmeasured = wall - sum(totals.values())
    out.append(f"| (outside the steps: dispatch, skips, evidence) | {len(ran)} | {unmeasured:.2f} | "
               f"{100 * unmeasured / wall:.1f}% |" if wall else "| (outside the steps) | 0 | 0 | - |")
    out += ["", f"## The {min(slowest, len(ran))} slowest cases", "",
            "| case | verdict | seconds | steps |", "| --- | --- | ---: | --- |"]
    for record in sorted(ran, key=lambda r: -r.seconds)[:slowest]:
        steps = ", ".join(f"{step} {seconds:.2f}" for step, seconds in
                          sorted(record.step_seconds.items(), key=lambda kv: -kv[1])[:5])
        out.append(f"| {record.case} | {record.verdict.value} | {record.seconds:.2f} | {steps} |")
    return "\n".join(out) + "\n"
