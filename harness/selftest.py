"""The bug zoo's self-test (`qgather selftest`, `make selftest`): does the harness catch every bug?

Each mutant of `harness.impls.mutants` runs its catching cases through the engine (gloo, CPU, on
the warm rank pools), and the same cases run with the reference substituted. A mutant is caught
on a case when
  - it gets its expected verdict there, a verdict the policy fails, and
  - the reference passes the same case: EXACT, or REJECTED where the policy accepts a rejection
    (a shape whose shards split a scale block, the only cases that expose bug classes 1 and 2).
A case the reference fails too proves nothing about the mutant, so it never counts as a catch.

One line per mutant, then the reference's verdicts, and last `mutants caught: X/N`; the exit
status is 0 only when every mutant is caught.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from harness.cases import CaseSpec
from harness.engine import RunOptions, run_case
from harness.impls.mutants import MUTANTS, Mutant
from harness.verdicts import CaseReport, Verdict

OPTIONS = RunOptions(backend="gloo", device="cpu")

_REPORTS: dict[str, CaseReport] = {}  # case id -> report, for this process (pools stay warm too)


def run(case_id: str) -> CaseReport:
    """The report of one case, run once per process."""
    if case_id not in _REPORTS:
        _REPORTS[case_id] = run_case(CaseSpec.parse(case_id), OPTIONS)
    return _REPORTS[case_id]


def reference_case(case_id: str) -> str:
    """The same case with the reference implementation substituted."""
    spec = CaseSpec.parse(case_id)
    return CaseSpec("reference", spec.fmt, spec.shape, spec.dtype, spec.world_size, spec.scenario, spec.seed).id


def reference_passes(report: CaseReport) -> bool:
    return report.verdict in (Verdict.EXACT, Verdict.REJECTED) and report.passed


@dataclass
class CaseCheck:
    case_id: str
    report: CaseReport
    reference: CaseReport
    expected: Verdict

    @property
    def caught(self) -> bool:
        return (self.report.verdict is self.expected and not self.report.passed
                and reference_passes(self.reference))

    def reference_line(self) -> str:
        ref = self.reference
        if ref.verdict is Verdict.EXACT:
            return f"    reference EXACT on {ref.spec.id}"
        if reference_passes(ref):
            return f"    reference REJECTED on {ref.spec.id} (accepted: {ref.expectation.reason})"
        return (f"    reference {ref.verdict.value} on {ref.spec.id}: the reference fails this case too, "
                "so it cannot catch the mutant")


@dataclass
class MutantResult:
    mutant: type[Mutant]
    checks: list[CaseCheck]

    @property
    def caught(self) -> bool:
        return any(c.caught for c in self.checks)

    @property
    def shown(self) -> CaseCheck:
        """The case the summary line names: the first that caught the mutant, else the first."""
        return next((c for c in self.checks if c.caught), self.checks[0])

    def line(self) -> str:
        m, shown = self.mutant, self.shown
        return (f"{m.name}  bug {m.bug_class}  expected {m.expected.value}  got {shown.report.verdict.value} "
                f"on {shown.case_id}  {'caught' if self.caught else 'MISSED'}")

    def lines(self, verbose: bool = False) -> list[str]:
        out = [self.line()]
        for check in self.checks:
            if verbose or not self.caught:
                out.extend("    " + line for line in check.report.render().splitlines())
            out.append(check.reference_line())
        return out


def check_mutant(mutant: type[Mutant]) -> MutantResult:
    """Run one mutant's catching cases and the reference on the same cases."""
    if not mutant.catching_cases:
        raise ValueError(f"{mutant.name} names no catching case")
    checks = []
    for case_id in mutant.catching_cases:
        reference = run(reference_case(case_id))
        checks.append(CaseCheck(case_id, run(case_id), reference, mutant.expected))
    return MutantResult(mutant, checks)


def _select(names: Sequence[str]) -> list[type[Mutant]]:
    if not names:
        return list(MUTANTS)
    by_name = {m.bug: m for m in MUTANTS} | {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"qgather selftest: unknown mutant {unknown[0]!r}; "
                         f"choose from {', '.join(m.bug for m in MUTANTS)}")
    return [by_name[n] for n in names]


def _warm_order(mutants: list[type[Mutant]]) -> list[type[Mutant]]:
    """Mutants expected to raise on some ranks only abort their pool (the other ranks wait in the
    collective until they are killed); run them last so the warm pools serve the rest."""
    return sorted(mutants, key=lambda m: m.expected is Verdict.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qgather selftest", description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", metavar="MUTANT", help="only these (e.g. nibble_swap)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case's full report")
    parser.add_argument("--keep-pools", action="store_true",
                        help="leave the rank pools running (for callers that run more cases)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    mutants = _select(args.mutants)
    try:
        results = {m: check_mutant(m) for m in _warm_order(mutants)}
    finally:
        if not args.keep_pools:
            from harness.runtime import shutdown_pools

            shutdown_pools()
    caught = 0
    for mutant in mutants:
        result = results[mutant]
        caught += result.caught
        print("\n".join(result.lines(args.verbose)))
    print(f"mutants caught: {caught}/{len(mutants)}")
    return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
