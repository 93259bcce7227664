"""What happened to a case: the `Verdict`, one closed set.

Which verdicts pass a case is the policy's to say (qgather.model.policy); how a verdict is decided
from every rank's results is the engine's (qgather.engine.classify); the case's report is
qgather.model.report.CaseReport.
"""

from __future__ import annotations

import enum


class Verdict(str, enum.Enum):
    EXACT = "EXACT"
    REJECTED = "REJECTED"  # an error raised on every rank, naming a constraint
    SILENT_MISMATCH = "SILENT_MISMATCH"  # ranks agree, but not with the golden
    RANK_DIVERGENCE = "RANK_DIVERGENCE"  # ranks hold different gathered results
    DEGRADED = "DEGRADED"  # gathered in high precision (the wire moved bf16/fp32 values)
    QUANTIZER_MISMATCH = "QUANTIZER_MISMATCH"  # its own quantizer disagrees with the reference
    ERROR = "ERROR"  # an exception on some ranks only (the others waited), not the same one, or an internal fault
    HANG = "HANG"
    CRASH = "CRASH"
    SKIPPED = "SKIPPED"
