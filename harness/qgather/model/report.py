"""The one report of a case (`CaseReport`), built once by the engine: every output (terminal,
JSON, Markdown, JUnit, baseline) is made from it."""

from __future__ import annotations

from dataclasses import dataclass

from qgather.model.case import CaseSpec
from qgather.model.policy import Expectation
from qgather.model.repro import repro_command
from qgather.model.verdict import Verdict

UNPLACED = "unplaced"  # CaseReport.ran_on of a case skipped because no pool of its size can exist here


@dataclass(frozen=True)
class CaseReport:
    """One case's verdict with its evidence, built once by the engine and never changed.

    Args:
        spec: the case.
        verdict, reason: what happened, and one line saying why.
        details: evidence lines (per-rank errors, differences, stacks).
        expectation: the policy's view of the case (None only for a report made before it could be
            asked, e.g. a case id that names no known format).
        duration_s: wall time of the whole case.
        placement: under a launcher, "intra-node" or "cross-node".
        repro: the command that reruns the case under the run's options (default: `qgather case <id>`).
        seconds: where the case's time went, step by step (qgather.engine.run.step_seconds).
        ran_on: where its ranks ran: "nccl/cuda", "gloo/cuda", "gloo/cpu", "virtual" (one process),
            UNPLACED (no pool of its size could exist here), "" (not run: skipped before any pool).
        stage: the stage the verdict was found at ("unshard 1"; "" when it is not a stage's, e.g. an
            error or a hang): the reason then reads "<stage>: <finding>".
    """

    spec: CaseSpec
    verdict: Verdict
    reason: str
    details: tuple[str, ...] = ()
    expectation: Expectation | None = None
    duration_s: float = 0.0
    placement: str = ""
    repro: str = ""
    seconds: tuple[tuple[str, float], ...] = ()
    ran_on: str = ""
    stage: str = ""

    def __post_init__(self) -> None:
        if not self.repro:
            object.__setattr__(self, "repro", repro_command(self.spec.id))

    @property
    def finding(self) -> str:
        """What was found at the stage: the reason without its "<stage>: " (the whole reason without a stage)."""
        return self.reason.removeprefix(f"{self.stage}: ") if self.stage else self.reason

    @property
    def passed(self) -> bool:
        if self.verdict is Verdict.SKIPPED:
            return True
        return self.expectation is not None and self.expectation.accepts(self.verdict)

    def render(self) -> str:
        head = f"{self.spec.id}: {self.verdict.value}"
        if self.reason:
            head += f" - {self.reason}"
        lines = [head, *(f"  {d}" for d in self.details)]
        if not self.passed and self.expectation is not None:
            lines.append(f"  expected {self.expectation.wanted()}")
        if self.verdict is not Verdict.SKIPPED:
            lines.append(f"  reproduce: {self.repro}")
        return "\n".join(lines)
