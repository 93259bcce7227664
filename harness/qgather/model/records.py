"""Typed records a rank sends back for one case: what a verdict is decided from.

Frozen dataclasses of strings, numbers and enums (no tensors): they travel between processes by
pickle, read the same on every rank, and are rendered to text only where a report is made
(`BufferDiff.line`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DiffProblem(str, enum.Enum):
    """How one buffer of a gathered weight differs from its reference's."""

    MISSING = "missing"  #: the reference has the buffer, the gathered weight does not
    HELD_ONLY = "held only"  #: only one side holds it (the te model: `detail` says which side)
    SHAPE = "shape"  #: another shape (`detail`: both shapes)
    DTYPE = "dtype"  #: another element size (`detail`: both dtypes)
    BITS = "bits"  #: same layout, differing bits inside the valid region (`n_diff` of `n_valid`)
    VALUES = "values"  #: the dequantized values differ (`n_diff` values, largest |diff| `max_abs`)

    @property
    def breaks_layout(self) -> bool:
        """Whether the buffer cannot even be read in the reference's layout (nothing to dequantize)."""
        return self in (DiffProblem.MISSING, DiffProblem.HELD_ONLY, DiffProblem.SHAPE, DiffProblem.DTYPE)


@dataclass(frozen=True)
class BufferDiff:
    """One buffer that differs from its reference, as data; `line()` renders it for a report."""

    name: str
    problem: DiffProblem
    n_diff: int = 0  # BITS: elements (or, with n_valid 0, bytes) that differ; VALUES: values that differ
    n_valid: int = 0  # BITS: elements compared (the valid region); 0 when n_diff counts bytes
    max_abs: float = 0.0  # VALUES: the largest |difference|
    detail: str = ""  # MISSING, HELD_ONLY, SHAPE, DTYPE: what the two sides hold

    def line(self) -> str:
        """One line naming the buffer and what differs, e.g. `rowwise_data: 3 of 4096 valid elements differ`."""
        if self.problem is DiffProblem.BITS:
            if self.n_valid:
                return f"{self.name}: {self.n_diff} of {self.n_valid} valid elements differ"
            return f"{self.name}: {self.n_diff} bytes differ"
        if self.problem is DiffProblem.VALUES:
            return f"{self.name}: {self.n_diff} dequantized values differ, max |diff| {self.max_abs:.3g}"
        return f"{self.name}: {self.problem.value} {self.detail}".rstrip()


@dataclass(frozen=True)
class Comparison:
    """Values against the golden's, bit for bit (or within `tolerance` when another kernel computed them)."""

    equal: bool
    n_diff: int = 0
    max_abs: float = 0.0
    tolerance: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class ModuleCheck:
    """The library's own layer forward (e.g. te.Linear under te.autocast) with the gathered weight,
    against the same module on one device holding the full weight: the same kernels, so bit for bit."""

    output: Comparison | None = None
    error: str = ""  # the sharded module's forward raised although the one-device module's did not
    note: str = ""  # why there is nothing to compare (the one-device module cannot run this shape either)


#: The label of a case's first gather on a pool (qgather.scenarios.fsdp), and that of its emulation in
#: one process (qgather.scenarios.virtual), which stands for it: a failure found at either is found at
#: the same stage of the case (`qgather sweep` groups the two together).
FIRST_UNSHARD = "unshard 1"
VIRTUAL_GATHER = "virtual gather"
STANDS_FOR = {VIRTUAL_GATHER: FIRST_UNSHARD}


@dataclass(frozen=True)
class Stage:
    """One gathered (unsharded) weight, compared with its golden on one rank."""

    label: str
    quantized: bool = True
    digest: str = ""
    buffer_diffs: tuple[BufferDiff, ...] = ()
    dequantized: Comparison | None = None  # the gathered buffers dequantized by the reference format
    own_dequantized: Comparison | None = None  # the implementation's own dequantize()
    output: Comparison | None = None  # the layer output
    output_digest: str = ""
    forward_error: str = ""  # the forward raised after the gather (the comparisons above still count)
    where: tuple[str, ...] = ()  # where the buffers differ, in row layout
    values: Comparison | None = None  # a plain (high-precision) gathered weight against the golden values
    accepted_unholdable: str = ""  # the format cannot hold the shape, yet the implementation gathered it
    module: ModuleCheck | None = None  # the library's own forward against the same module on one device
    dtype_problem: str = ""  # the unsharded weight's dtype is not the one the mixed-precision policy asks for
    note: str = ""  # how the stage ran (e.g. the torch.compile backend), shown with an EXACT verdict
    piece: str = ""  # tensor parallelism: which TP piece this rank gathered; ranks agree only within a piece
    #: a weight of a several-weight module that the implementation refused with its declared rejection
    #: (one line), on every rank, before any of its data moved; the module was built without it
    refused: str = ""
    refusal_accepted: bool = False  # the policy accepts that refusal (the weight is not aligned)


@dataclass(frozen=True)
class WireSummary:
    """What went over the wire in the case's first unshard (of one weight), per rank (qgather.check.wire)."""

    collective_bytes: int = 0
    collectives: int = 0
    hook_calls: int = 0
    hook_outputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    high_precision_elements: int = 0
    shard_numel: int = 0
    param_itemsize: int = 0
    packed_bytes: int | None = None
    wire_mode: str = ""
    allowed_bytes: int | None = None
    label: str = ""  # which weight, in a case of several (empty: the case's one weight)


@dataclass(frozen=True)
class RankResult:
    """Everything one rank reports for a case that returned."""

    rank: int
    stages: tuple[Stage, ...]
    wire: WireSummary | None = None
    #: its own quantizer against the reference formats (None: no quantizer of its own; empty: they agree)
    quantizer: tuple[BufferDiff, ...] | None = None
    #: (step, seconds) on this rank, in the order the steps ran (qgather.model.phases.PhaseTracker)
    seconds: tuple[tuple[str, float], ...] = ()
    #: (step, wall-clock second it first started on this rank; one clock for the ranks of a host)
    started: tuple[tuple[str, float], ...] = ()
    #: (step, bytes) for each step in which the device's peak memory rose (PhaseTracker.high_water)
    high_water: tuple[tuple[str, int], ...] = ()
    #: a case of several weights (the layers scenario): each weight's first gather, labelled
    wires: tuple[WireSummary, ...] = ()
