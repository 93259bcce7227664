"""One case as every report sees it: `CaseRecord`, built once from the case's report and the run's
options, then given pytest's outcome (and a baseline's known issue) with `dataclasses.replace`.

The terminal summary, verdicts.json, verdicts.md, JUnit's properties and `qgather baseline update`
all read these fields; none of them goes back to the case id to recover one. A record crosses from
an xdist worker to the controller as a plain dict (`to_dict` / `from_dict`, an exact round trip).

    record = CaseRecord.build(report, options)             # on the process that ran the case
    record = dataclasses.replace(record, checked=True)      # the test's outcome is the case's
    record = dataclasses.replace(record, outcome=Outcome.FAILED)   # from pytest's report
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from qgather.errors import HarnessFault
from qgather.formats import FORMATS, FormatError
from qgather.model.case import CaseSpec, shard_layout
from qgather.model.known_issues import KnownIssue
from qgather.model.policy import expectation
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict

DEFAULT_CONFIG = "default"  # the configuration label of a case FSDP2 runs with its defaults


class Outcome(str, enum.Enum):
    """pytest's outcome of the test that checked a case (its `qgather.check`)."""

    PASSED = "passed"
    FAILED = "failed"  # the policy does not accept the verdict, or a baseline entry went stale
    SKIPPED = "skipped"  # the verdict is SKIPPED
    XFAILED = "xfailed"  # a failure the baseline lists: a known issue
    XPASSED = "xpassed"  # not produced by qgather itself (its xfails are imperative); a marker's

    @property
    def rank(self) -> int:
        """How bad the outcome is, for a case two tests checked: the worse one is the case's."""
        return _OUTCOME_RANK[self]


_OUTCOME_RANK = {Outcome.SKIPPED: 0, Outcome.PASSED: 1, Outcome.XFAILED: 2, Outcome.XPASSED: 3, Outcome.FAILED: 4}


class RecordError(HarnessFault):
    """A record dict that is not one `CaseRecord.to_dict` wrote (a missing, unknown or mistyped field)."""


class RunSettings(Protocol):
    """What a record reads of the run's options (qgather.engine.run.RunOptions)."""

    backend: str
    device: str
    case_timeout: float | None

    def device_type(self) -> str: ...

    def backend_for(self, world_size: int) -> str: ...


@dataclass(frozen=True)
class CaseRecord:
    """One case's verdict with everything a report shows of it.

    `checked` says that a test's outcome is this case's (the test called `qgather.check` on it); a
    case run inside another test (`qgather.run`) has `checked=False` and no outcome of its own.
    """

    case: str  # the case id
    implementation: str
    format: str
    world_size: int
    shape_class: str  # aligned / misaligned / unholdable, then `uneven`, `zero-row`
    scenario: str
    fsdp_config: str  # the id's configuration token, DEFAULT_CONFIG for FSDP2's defaults
    configuration: str  # the report label: scenario, configuration, device/backend, placement
    verdict: Verdict
    passed: bool  # the policy accepts the verdict
    reason: str
    repro: str  # the command that reruns the case (qgather.model.repro.repro_command)
    report: str  # the full case report (CaseReport.render)
    seconds: float = 0.0
    #: where those seconds went: step -> seconds (qgather.engine.run.step_seconds); empty when not measured
    step_seconds: dict[str, float] = field(default_factory=dict)
    placement: str = ""  # under a launcher: intra-node | cross-node
    ran_on: str = ""  # where its ranks ran (CaseReport.ran_on): nccl/cuda, gloo/cuda, gloo/cpu, virtual, unplaced
    checked: bool = False
    outcome: Outcome | None = None
    known_issue: KnownIssue | None = None

    @classmethod
    def build(cls, report: CaseReport, options: RunSettings) -> CaseRecord:
        """The record of a case's report under the run's options (no outcome yet)."""
        spec = report.spec
        fsdp_config = spec.config.token or DEFAULT_CONFIG
        return cls(
            case=spec.id,
            implementation=spec.impl,
            format=spec.fmt,
            world_size=spec.world_size,
            shape_class=safe_shape_class(spec),
            scenario=spec.scenario,
            fsdp_config=fsdp_config,
            configuration=_configuration(spec, fsdp_config, options, report.placement),
            verdict=report.verdict,
            passed=report.passed,
            reason=report.reason,
            repro=report.repro,
            report=report.render(),
            seconds=round(report.duration_s, 3),
            step_seconds={step: round(value, 4) for step, value in report.seconds},
            placement=report.placement,
            ran_on=report.ran_on,
        )

    @property
    def as_expected(self) -> bool:
        """Counted as expected: pytest passed the test that checked it (a known issue is counted apart)."""
        return self.outcome is Outcome.PASSED

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (it travels in xdist's reports and into verdicts.json)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["verdict"] = self.verdict.value
        out["outcome"] = None if self.outcome is None else self.outcome.value
        out["known_issue"] = None if self.known_issue is None else self.known_issue.as_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseRecord:
        """The record `to_dict` wrote. A verdicts.json of an older qgather may lack the descriptive
        fields (it needs `case`, `verdict`, `passed`); an unknown field or value is an error."""
        if not isinstance(data, dict):
            raise RecordError(f"a case record is a dict, got {type(data).__name__}")
        unknown = sorted(set(data) - _FIELD_NAMES - _OLD_FIELDS)
        missing = [name for name in ("case", "verdict", "passed") if name not in data]
        if unknown or missing:
            what = f"unknown field {unknown[0]!r}" if unknown else f"no {missing[0]!r}"
            raise RecordError(f"case record {data.get('case', '?')!r}: {what}")
        values = {k: v for k, v in data.items() if k in _FIELD_NAMES}
        try:
            values["verdict"] = Verdict(values["verdict"])
            if values.get("outcome") is not None:
                values["outcome"] = Outcome(values["outcome"])
            if values.get("known_issue") is not None:
                values["known_issue"] = KnownIssue(**values["known_issue"])
        except (ValueError, TypeError) as exc:
            raise RecordError(f"case record {data['case']!r}: {exc}") from None
        return cls(**{**_ABSENT, **values})


_FIELD_NAMES = frozenset(f.name for f in fields(CaseRecord))
_OLD_FIELDS = frozenset({"impl"})  # verdicts.json before CaseRecord: ignored when read back
_ABSENT: dict[str, Any] = {"implementation": "", "format": "", "world_size": 0, "shape_class": "", "scenario": "",
                           "fsdp_config": "", "configuration": "", "reason": "", "repro": "", "report": ""}


def _configuration(spec: CaseSpec, fsdp_config: str, options: RunSettings, placement: str) -> str:
    if spec.scenario == "virtual":  # one process emulates the world: no backend
        where = options.device_type()
    else:
        where = f"{options.device_type()}/{options.backend_for(spec.world_size)}"
    config = "" if fsdp_config == DEFAULT_CONFIG else f" {fsdp_config}"
    return f"{spec.scenario}{config} {where}" + (f" {placement}" if placement else "")


def shape_class(spec: CaseSpec) -> str:
    """aligned / misaligned / unholdable (the policy's view of the shape), then `uneven` and
    `zero-row` when FSDP2's dim-0 split is uneven or leaves a rank without rows."""
    fmt = FORMATS.get(spec.fmt)
    if fmt is None:
        return "unknown format"
    try:
        fmt.check(spec.shape, spec.torch_dtype)
    except FormatError:
        alignment = "unholdable"
    else:
        alignment = "aligned" if expectation(spec).aligned else "misaligned"
    layout = shard_layout(spec)
    tags = [] if layout.even else ["uneven"]
    if any(start == end for start, end in map(layout.dim0_range, range(layout.world_size))):
        tags.append("zero-row")
    return " ".join([alignment, *tags])


def safe_shape_class(spec: CaseSpec) -> str:
    """`shape_class`, or `unknown (<error>)`: a report label must never fail a case."""
    try:
        return shape_class(spec)
    except Exception as exc:  # noqa: BLE001 - a report label must never fail a case
        return f"unknown ({type(exc).__name__})"
