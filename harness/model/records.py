"""Typed records a rank sends back for one case, and what a verdict is decided from.

Plain dataclasses of strings and numbers (no tensors): they travel between processes by pickle and
read the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Comparison:
    """Values against the golden's, bit for bit (or within `tolerance` when another kernel computed them)."""

    equal: bool
    n_diff: int = 0
    max_abs: float = 0.0
    tolerance: str | None = None
    detail: str = ""


@dataclass
class Stage:
    """One gathered (unsharded) weight, compared with its golden on one rank."""

    label: str
    quantized: bool = True
    digest: str = ""
    buffer_diffs: list[str] = field(default_factory=list)
    dequantized: Comparison | None = None  # the gathered buffers dequantized by the reference format
    own_dequantized: Comparison | None = None  # the implementation's own dequantize()
    output: Comparison | None = None  # the layer output
    output_digest: str = ""
    forward_error: str = ""  # the forward raised after the gather (the comparisons above still count)
    where: list[str] = field(default_factory=list)  # where the buffers differ, in row layout
    values: Comparison | None = None  # a plain (high-precision) gathered weight against the golden values
    accepted_unholdable: str = ""  # the format cannot hold the shape, yet the implementation gathered it
    module: ModuleCheck | None = None  # the library's own forward against the same module on one device
    dtype_problem: str = ""  # the unsharded weight's dtype is not the one the mixed-precision policy asks for
    note: str = ""  # how the stage ran (e.g. the torch.compile backend), shown with an EXACT verdict


@dataclass
class ModuleCheck:
    """The library's own layer forward (e.g. te.Linear under te.autocast) with the gathered weight,
    against the same module on one device holding the full weight: the same kernels, so bit for bit."""

    output: Comparison | None = None
    error: str = ""  # the sharded module's forward raised although the one-device module's did not
    note: str = ""  # why there is nothing to compare (the one-device module cannot run this shape either)


@dataclass
class WireSummary:
    """What went over the wire in the case's first unshard, per rank (qgather.check.wire)."""

    collective_bytes: int = 0
    collectives: int = 0
    hook_calls: int = 0
    hook_outputs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    high_precision_elements: int = 0
    shard_numel: int = 0
    param_itemsize: int = 0
    packed_bytes: int | None = None
    wire_mode: str = ""
    allowed_bytes: int | None = None


@dataclass
class RankResult:
    """Everything one rank reports for a case that returned."""

    rank: int
    stages: list[Stage]
    wire: WireSummary | None = None
    quantizer: list[str] | None = None  # its own quantizer against the reference formats (None: none of its own)
