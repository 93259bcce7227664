"""What a session's reports count, reconciled with pytest's final line: `RunResults`, one snapshot
of the recorder that the terminal summary, verdicts.json and verdicts.md all read.

Every report counts the same thing: unique case ids, each with the outcome of the test that
checked it (`qgather.check`). pytest's final line counts test reports instead; the two differ by
exactly these rows (`Row`), and each row's counts are in pytest's own categories:

- CASES: one per case id, the outcome of the test that checked it (when two tests checked the same
  id, the worse outcome is the case's);
- REPEATS: the other tests that checked an id another test checked too;
- OTHER: the other tests, not one case each: they ran no case (e.g. the dispatch-op tests), several
  (e.g. the virtual/real agreement test), or never reached their case (a setup error or skip);
- AROUND: setup/teardown errors of tests that checked a case.

so that pytest's count of each category is the sum of the rows' (`RunResults.pytest`).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from qgather.model.case_record import CaseRecord, Outcome

#: the other tests, said once for every report (the summary's line, verdicts.md's)
OTHER_TESTS = "each check something that is not one case (an adapter's tensor ops, virtual ranks against real ones)"
ALSO_RAN = "which pass or fail with their test"

# pytest's own order of its final line (_pytest/terminal.py KNOWN_TYPES), outcomes only.
PYTEST_ORDER = ("failed", "passed", "skipped", "xfailed", "xpassed", "error")


class Row(str, enum.Enum):
    """Where a test report counts (see the module docstring)."""

    CASES = "case tests: one test, one case"
    REPEATS = "case tests repeating a case counted above"
    OTHER = "other tests"
    AROUND = "set-up/teardown errors of case tests"


@dataclass(frozen=True)
class RunResults:
    """A snapshot of the session's records, as every report shows it."""

    cases: tuple[CaseRecord, ...]  # one per case id a test checked, with its outcome
    also_ran: tuple[CaseRecord, ...]  # case ids run only inside tests that are not one case each
    rows: Mapping[Row, Mapping[str, int]]  # pytest categories per row
    other_tests: int  # how many tests are not one case each
    failing_other_tests: tuple[str, ...] = ()  # node ids of those that failed or errored
    ran_nothing: Mapping[str, str] = field(default_factory=dict)  # --impl name -> first skip reason
    unplaced: tuple[CaseRecord, ...] = ()  # cases the host's GPUs could run on NCCL, skipped instead

    @property
    def pytest(self) -> dict[str, int]:
        """pytest's final line: every row's counts added up."""
        total: Counter[str] = Counter()
        for counts in self.rows.values():
            total.update(counts)
        return _ordered(total)

    @property
    def outcomes(self) -> dict[str, int]:
        """The cases by outcome (they add up to the number of cases)."""
        counts = Counter(r.outcome.value for r in self.cases if r.outcome is not None)
        return {o.value: counts[o.value] for o in Outcome}

    @property
    def verdicts(self) -> dict[str, int]:
        """The cases by verdict."""
        return dict(Counter(r.verdict.value for r in self.cases))

    def by_implementation(self) -> dict[str, Counter[str]]:
        """Verdict counts of the cases per implementation."""
        out: dict[str, Counter[str]] = {}
        for record in self.cases:
            out.setdefault(record.implementation, Counter())[record.verdict.value] += 1
        return dict(sorted(out.items()))

    @property
    def failures(self) -> tuple[CaseRecord, ...]:
        """Cases that fail the run: pytest failed (or xpassed) the test that checked them."""
        return tuple(r for r in self.cases if r.outcome in (Outcome.FAILED, Outcome.XPASSED))

    @property
    def known_issues(self) -> tuple[CaseRecord, ...]:
        """Cases the baseline lists that still fail: xfailed, counted apart from the failures."""
        return tuple(r for r in self.cases if r.outcome is Outcome.XFAILED)

    def headline(self) -> str:
        """`N cases (unique ids): A as expected, F not as expected, K known issues (--baseline), S skipped`."""
        outcomes = self.outcomes
        parts = [f"{outcomes['passed']} as expected", f"{len(self.failures)} not as expected"]
        if outcomes["xfailed"]:
            parts.append(f"{outcomes['xfailed']} known issues (--baseline)")
        if outcomes["skipped"]:
            parts.append(f"{outcomes['skipped']} skipped")
        return f"{len(self.cases)} cases (unique ids): " + ", ".join(parts)

    def reconciliation(self) -> list[list[str]]:
        """A table (header first) of pytest's categories per row, then pytest's own total."""
        present = [c for c in (*PYTEST_ORDER, *sorted(self.pytest)) if self.pytest.get(c)]
        present = list(dict.fromkeys(present))
        table = [["tests", *present, "total"]]
        for row in Row:
            counts = self.rows.get(row, {})
            if row is not Row.CASES and not sum(counts.values()):
                continue
            table.append([row.value, *(str(counts.get(c, 0)) for c in present), str(sum(counts.values()))])
        table.append(["pytest's final line", *(str(self.pytest[c]) for c in present), str(sum(self.pytest.values()))])
        return table

    def other_tests_line(self) -> str:
        """What the other tests are, and the cases they ran, in words ("" when there are none)."""
        if not self.other_tests:
            return ""
        tests = "1 other test" if self.other_tests == 1 else f"{self.other_tests} other tests"
        line = f"{tests} {OTHER_TESTS}"
        if not self.also_ran:
            return line
        cases = "1 more case" if len(self.also_ran) == 1 else f"{len(self.also_ran)} more cases"
        return f"{line}; they ran {cases}, not counted above, {ALSO_RAN} (verdicts.json: also_ran)"


def _ordered(counts: Mapping[str, int]) -> dict[str, int]:
    keys = [*PYTEST_ORDER, *sorted(set(counts) - set(PYTEST_ORDER))]
    return {k: counts.get(k, 0) for k in keys if counts.get(k, 0) or k in PYTEST_ORDER}
