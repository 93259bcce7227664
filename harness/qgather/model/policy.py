"""The verdict policy: which verdicts pass a case. The one place this is decided.

A shape whose every shard is aligned to the format's row (or column) block passes only as EXACT; a
shape that violates alignment, or that the format cannot hold at all, passes as EXACT or REJECTED.
Everything else fails, with a report that says why.

A `layers` or `block` case holds several weights (qgather.model.layers): it is aligned only if every weight is,
and a refusal is acceptable only of a weight that is not (`refusal_accepted`); the case is REJECTED
only once the weights it kept were all judged EXACT (qgather.engine.classify).
"""

from __future__ import annotations

from dataclasses import dataclass

from qgather.formats import FORMATS, FormatError
from qgather.model.block import module_weights
from qgather.model.case import CaseSpec, saved_spec
from qgather.model.layers import MODULE_SCENARIOS
from qgather.model.layout import alignment_problem
from qgather.model.verdict import Verdict


@dataclass(frozen=True)
class Expectation:
    """What a case may end as: `aligned` cases only EXACT; others EXACT or REJECTED (`reason` says why)."""

    aligned: bool
    reason: str  # why a rejection would be acceptable (empty when aligned)

    def accepts(self, verdict: Verdict) -> bool:
        if verdict is Verdict.EXACT:
            return True
        return verdict is Verdict.REJECTED and not self.aligned

    def wanted(self) -> str:
        """'EXACT' or 'EXACT or REJECTED', with why, for a failure report."""
        if self.aligned:
            return "EXACT (every shard is aligned)"
        return f"EXACT or REJECTED ({self.reason})"


def expectation(spec: CaseSpec) -> Expectation:
    """The policy's expectation of a case, from its format's rules and FSDP2's split at its world size;
    for a `layers` or `block` case, of every weight of its module (aligned only if every weight is)."""
    if spec.scenario not in MODULE_SCENARIOS:
        return _one_weight(spec)
    reasons = []
    for weight in module_weights(spec):
        wanted = _one_weight(weight.spec)
        if not wanted.aligned:
            reasons.append(f"{weight.title}: {wanted.reason}")
    return Expectation(not reasons, "; ".join(reasons))


def refusal_accepted(spec: CaseSpec) -> bool:
    """Whether the policy accepts a refusal of the weight `spec` describes (it is not aligned)."""
    return not _one_weight(spec).aligned


def _one_weight(spec: CaseSpec) -> Expectation:
    fmt = FORMATS[spec.fmt]
    try:
        fmt.check(spec.shape, spec.torch_dtype)
    except FormatError as exc:
        return Expectation(False, str(exc))
    # a checkpoint saved at world size A was sharded there too: aligned only if aligned at both sizes
    saved = spec.config.saved_at_world_size
    for case in (spec, *(() if saved is None else (saved_spec(spec),))):
        problem = alignment_problem(case)  # rows, or K under dim1, over the shard mesh (and the tp split)
        if problem:
            at = f" at world size {saved} (where the checkpoint was saved)" if case is not spec else ""
            return Expectation(False, problem + at)
    return Expectation(True, "")
