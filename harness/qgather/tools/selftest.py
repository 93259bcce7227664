"""The bug zoo's self-test (`qgather selftest`, `make selftest`): does the harness catch every bug?

Each mutant of `qgather.impls.mutants` runs its catching cases through the engine (gloo, CPU, on
the warm rank pools), and the same cases run with the reference substituted. A mutant is caught
on a case when
  - it gets its expected verdict there, a verdict the policy fails, and
  - the reference passes the same case: EXACT, or REJECTED where the policy accepts a rejection
    (a shape whose shards split a scale block, the only cases that expose bug classes 1 and 2).
A case the reference fails too proves nothing about the mutant, so it never counts as a catch.

One line per mutant, then the reference's verdicts, and last `mutants caught: X/N`; the exit
status is 0 only when every mutant is caught.

`qgather selftest --suite` (mutation mode) runs every mutant over a fixed sample of the default
suite (see `suite_sample` and docs/mutation-mode.md) instead of its catching cases only. A mutant is
KILLED by a case where the reference passes and the mutant fails with a verdict of its class
(`Mutant.verdicts`, the failing verdicts consistent with its bug); a failing verdict outside that
class where the reference passes is a wrong-class verdict. Each mutant's line counts its kills on
cases of the default suite (the sample holds cases the suite runs, `drawn` from it); the last line is
`mutants killed: X/Y, wrong-class verdicts: Z, killed by >= 10 cases of the default suite: W/Y`; the
exit status is 0 only when X == W == Y and Z == 0.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache

from qgather.engine.run import RunOptions, run_case
from qgather.errors import UsageError
from qgather.impls.mutants import MUTANTS, Mutant
from qgather.model.case import CaseSpec
from qgather.model.config import DEFAULT
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict
from qgather.runtime import shutdown_pools
from qgather.suite import depth
from qgather.suite.coverage import suite_cases
from qgather.suite.sweeps import core_shapes
from qgather.tools.arguments import selftest_parser

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
    return CaseSpec("reference", spec.fmt, spec.shape, spec.dtype, spec.world_size, spec.scenario, spec.seed,
                    spec.config).id


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
        raise UsageError(f"unknown mutant {unknown[0]!r}; choose from {', '.join(m.bug for m in MUTANTS)}")
    return [by_name[n] for n in names]


def _warm_order(mutants: list[type[Mutant]]) -> list[type[Mutant]]:
    """Mutants expected to raise on some ranks only abort their pool (the other ranks wait in the
    collective until they are killed); run them last so the warm pools serve the rest."""
    return sorted(mutants, key=lambda m: m.expected is Verdict.ERROR)


# ====================================================================== mutation mode (--suite)
SUITE_DTYPE = "bf16"
SUITE_WORLD_SIZES = (2, 3, 8)
SUITE_SCENARIOS = ("gather", "steps", "reshard")


#: cases of the default suite each catching case draws into its mutant's sample (`drawn`)
SUITE_DRAW = 20
#: the default suite's cases that must kill each mutant
MIN_SUITE_KILLS = 10


@cache
def default_suite() -> tuple[CaseSpec, ...]:
    """The default run's reference cases (`qgather run` without --impl), as `qgather list --cases` lists them."""
    cases, _ = suite_cases(["reference"], memo=True)
    return tuple(c for c in cases if c.impl == "reference")


@cache
def default_suite_ids() -> frozenset[str]:
    return frozenset(c.id for c in default_suite())


def _config_families(spec: CaseSpec) -> frozenset[str]:
    return depth.families(spec) - {spec.scenario}


def drawn(mutant: type[Mutant]) -> list[str]:
    """For each catching case, the SUITE_DRAW cases of the default suite most like it, as the mutant's
    cases: of its format and holding its configuration families (a `dcp-ws4` gather draws checkpointed
    cases; a case without a configuration draws its scenario's cases), the most alike first: the same
    scenario, the fewest other configuration families (none first), the same number of dims, the
    most of its shape classes (qgather.suite.depth.shape_classes), then in id order."""
    out = set()
    for case_id in mutant.catching_cases:
        catching = CaseSpec.parse(case_id)
        families, classes = _config_families(catching), depth.shape_classes(catching)
        pool = [c for c in default_suite() if c.fmt == catching.fmt and families <= _config_families(c)
                and (families or c.scenario == catching.scenario)]
        pool.sort(key=lambda c: (c.scenario != catching.scenario, len(_config_families(c) - families),
                                 len(c.shape) != len(catching.shape), -len(depth.shape_classes(c) & classes), c.id))
        out |= {replace(c, impl=mutant.name).id for c in pool[:SUITE_DRAW]}
    return sorted(out)


def suite_sample(mutant: type[Mutant]) -> list[str]:
    """The fixed sample one mutant runs over in mutation mode: the formats of its catching cases x the
    four core shapes (qgather.suite.sweeps.core_shapes; plus the catching shapes) x world sizes
    SUITE_WORLD_SIZES (plus the catching ones) x scenarios SUITE_SCENARIOS (plus the catching ones), bf16,
    seed 0; and the cases of the default suite its catching cases draw (`drawn`). The catching cases
    are always in it, so a mutant the plain self-test catches is killable."""
    catching = [CaseSpec.parse(c) for c in mutant.catching_cases]
    fmts = sorted({c.fmt for c in catching})
    sizes = sorted(set(SUITE_WORLD_SIZES) | {c.world_size for c in catching})
    scenarios = sorted(set(SUITE_SCENARIOS) | {c.scenario for c in catching})
    configs = sorted({c.config for c in catching} | {DEFAULT}, key=lambda c: c.token)
    ids = {c.id for c in catching}
    for fmt in fmts:
        shapes = set(core_shapes(fmt)) | {c.shape for c in catching if c.fmt == fmt}
        for shape in sorted(shapes):
            for ws in sizes:
                for scenario in scenarios:
                    for config in configs:  # a configuration's mutant also runs where its bug is silent
                        if config.check_world_size(ws) is None:
                            ids.add(CaseSpec(mutant.name, fmt, shape, SUITE_DTYPE, ws, scenario, 0, config).id)
    return sorted(ids | set(drawn(mutant)))


@dataclass
class SuiteResult:
    """One mutant's verdicts over its sample, each next to the reference's on the same case."""

    mutant: type[Mutant]
    pairs: list[tuple[CaseReport, CaseReport]]  # (mutant, reference)

    def _counted(self) -> list[tuple[CaseReport, CaseReport]]:
        return [(m, r) for m, r in self.pairs if reference_passes(r) and not m.passed]

    @property
    def kills(self) -> list[CaseReport]:
        kills = [m for m, _ in self._counted() if m.verdict in self.mutant.verdicts]
        return sorted(kills, key=lambda m: m.verdict is not self.mutant.expected)  # the expected verdict first

    @property
    def wrong_class(self) -> list[CaseReport]:
        return [m for m, _ in self._counted() if m.verdict not in self.mutant.verdicts]

    @property
    def killed(self) -> bool:
        return bool(self.kills)

    @property
    def suite_kills(self) -> int:
        """Kills on cases of the default suite (its reference twin is one of `qgather run`'s cases)."""
        suite = default_suite_ids()
        return sum(1 for m in self.kills if reference_case(m.spec.id) in suite)

    @property
    def deep(self) -> bool:
        return self.suite_kills >= MIN_SUITE_KILLS

    def line(self) -> str:
        counts = Counter(m.verdict.value for m, _ in self.pairs)
        shown = ", ".join(f"{v} {n}" for v, n in sorted(counts.items()))
        head = f"{self.mutant.bug}  bug {self.mutant.bug_class}  "
        head += f"killed by {self.kills[0].spec.id}" if self.killed else "SURVIVED"
        line = f"{head}  [{len(self.pairs)} cases: {shown}; killed by {self.suite_kills} cases of the default suite"
        line += "]" if self.deep else f", under {MIN_SUITE_KILLS}]"
        for report in self.wrong_class:
            line += f"\n    wrong-class {report.verdict.value} on {report.spec.id} " \
                    f"(expected one of {', '.join(sorted(v.value for v in self.mutant.verdicts))})"
            line += "".join(f"\n        {evidence}" for evidence in wrong_class_evidence(report))
        return line


EVIDENCE_LINES = 12


def wrong_class_evidence(report: CaseReport) -> list[str]:
    """Why the case ended where it did: its reason and first evidence lines (a CRASH's exit codes and
    stacks), so a wrong-class verdict seen once in CI can be diagnosed from the log alone."""
    lines = [report.reason, *report.details] if report.reason else list(report.details)
    shown = lines[:EVIDENCE_LINES]
    if len(lines) > EVIDENCE_LINES:
        shown.append(f"... {len(lines) - EVIDENCE_LINES} more lines: {report.repro}")
    return shown


def run_suite(mutants: Sequence[type[Mutant]], runner: Callable[[str], CaseReport] | None = None,
              ) -> list[SuiteResult]:
    """Run the reference once over the union of the samples, then every mutant over its own."""
    runner = runner or run
    samples = {m: suite_sample(m) for m in mutants}
    for case_id in sorted({reference_case(c) for ids in samples.values() for c in ids}):
        runner(case_id)
    return [SuiteResult(m, [(runner(c), runner(reference_case(c))) for c in samples[m]])
            for m in _warm_order(list(mutants))]


def suite_summary(results: Sequence[SuiteResult]) -> tuple[list[str], int]:
    """The per-mutant lines, the last line, and the exit status."""
    killed = sum(r.killed for r in results)
    wrong = sum(len(r.wrong_class) for r in results)
    deep = sum(r.deep for r in results)
    lines = [r.line() for r in results]
    lines.append(f"mutants killed: {killed}/{len(results)}, wrong-class verdicts: {wrong}, "
                 f"killed by >= {MIN_SUITE_KILLS} cases of the default suite: {deep}/{len(results)}")
    return lines, 0 if killed == deep == len(results) and wrong == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = selftest_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    mutants = _select(args.mutants)
    if args.suite:
        return _main_suite(mutants, args.keep_pools)
    try:
        results = {m: check_mutant(m) for m in _warm_order(mutants)}
    finally:
        if not args.keep_pools:
            shutdown_pools()
    caught = 0
    for mutant in mutants:
        result = results[mutant]
        caught += result.caught
        print("\n".join(result.lines(args.verbose)))
    print(f"mutants caught: {caught}/{len(mutants)}")
    return 0 if caught == len(mutants) else 1


def _main_suite(mutants: list[type[Mutant]], keep_pools: bool) -> int:
    n_cases = sum(len(suite_sample(m)) for m in mutants)
    n_ref = len({reference_case(c) for m in mutants for c in suite_sample(m)})
    print(f"mutation mode: {len(mutants)} mutants, {n_cases} mutant cases, {n_ref} reference cases", flush=True)
    try:
        results = run_suite(mutants)
    finally:
        if not keep_pools:
            shutdown_pools()
    by_mutant = {r.mutant: r for r in results}
    lines, status = suite_summary([by_mutant[m] for m in mutants])
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
