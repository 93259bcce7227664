"""What actually went over the wire during an unshard: the collective's bytes and the pre-hook's
outputs. A quantized gather moves about the format's packed size; a silent high-precision
fallback moves bf16/fp32 values (bug class 11), which no output comparison can see."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from qgather.check.golden import Golden
from qgather.formats import Format
from qgather.impls.base import Implementation
from qgather.instruments.patches import all_gathers_counted, pre_all_gather_observed
from qgather.model.case import ColumnShardLayout, ShardLayout
from qgather.model.records import WireSummary
from qgather.runtime import gather_note, whereabouts


@dataclass
class WireLog:
    """What the patches of `record_wire` saw while it was active (rank-local; summarized by
    `summarize_wire` into the WireSummary that travels)."""

    collective_bytes: int = 0
    collectives: int = 0
    hook_calls: int = 0
    hook_outputs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def snapshot(self) -> WireLog:
        """A copy of what was recorded so far (for `since`)."""
        return WireLog(self.collective_bytes, self.collectives, self.hook_calls, list(self.hook_outputs))

    def since(self, earlier: WireLog) -> WireLog:
        """What was recorded after `earlier`, a snapshot of this log: one weight's gather of several."""
        return WireLog(self.collective_bytes - earlier.collective_bytes, self.collectives - earlier.collectives,
                       self.hook_calls - earlier.hook_calls, self.hook_outputs[len(earlier.hook_outputs):])

    def high_precision_elements(self) -> int:
        """Elements of >= 16-bit floating dtypes handed to the gather by the pre-hook."""
        total = 0
        for dtype_name, shape in self.hook_outputs:
            dtype = getattr(torch, dtype_name)
            if dtype.is_floating_point and torch.finfo(dtype).bits >= 16:
                total += int(torch.Size(shape).numel())
        return total

    def count_gather(self, input: torch.Tensor) -> None:
        """One collective (the outermost all-gather call) and the bytes this rank handed it."""
        nbytes = input.numel() * input.element_size()
        self.collectives += 1
        self.collective_bytes += nbytes
        whereabouts.note(gather_note.KEY, gather_note.text(nbytes, self.collectives))

    def record_hook_outputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """One pre-all-gather hook call and the (dtype, shape) of each all-gather input it returned."""
        self.hook_calls += 1
        outputs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in inputs]
        self.hook_outputs.extend(outputs)
        whereabouts.note("pre-hook handed", ", ".join(f"{d}{list(s)}" for d, s in outputs))


@contextlib.contextmanager
def record_wire(param_types: tuple[type, ...] = ()) -> Iterator[WireLog]:
    """Count all-gather bytes and record the pre-hook outputs of `param_types` while active."""
    log = WireLog()
    with all_gathers_counted(log.count_gather), pre_all_gather_observed(param_types, log.record_hook_outputs):
        yield log


def summarize_wire(wire: WireLog, fmt: Format, weight: torch.Tensor, shards: ShardLayout | ColumnShardLayout,
                   golden: Golden, impl: Implementation, label: str = "") -> WireSummary:
    """What the case moved, beside what its packed shard needed and what the implementation may move
    (`weight`: the full weight, or a tensor of its shape and dtype, e.g. on the meta device; `label`:
    which weight, in a case of several)."""
    padded_rows = shards.chunk * shards.inner_rows
    # Shard(1) (qgather.model.case.ColumnShardLayout): every row, a 1/ws slice of the columns
    col_fraction = (shards.col_chunk, weight.shape[-1]) if isinstance(shards, ColumnShardLayout) else (1, 1)
    packed = packed_shard_bytes(fmt, golden, padded_rows)
    packed_bytes = None if packed is None else packed * col_fraction[0] // col_fraction[1]
    wire_mode, allowed_bytes = "", None
    if packed_bytes:
        wire_mode, allowed_bytes = impl.wire_allowance(fmt.name, tuple(weight.shape), shards, packed_bytes)
    return WireSummary(collective_bytes=wire.collective_bytes, collectives=wire.collectives,
                       hook_calls=wire.hook_calls, hook_outputs=tuple(wire.hook_outputs),
                       high_precision_elements=wire.high_precision_elements(),
                       shard_numel=padded_rows * weight.shape[-1] * col_fraction[0] // col_fraction[1],
                       param_itemsize=weight.element_size(), packed_bytes=packed_bytes,
                       wire_mode=wire_mode, allowed_bytes=allowed_bytes, label=label)


def packed_shard_bytes(fmt: Format, golden: Golden, shard_rows: int) -> int | None:
    """Bytes of one shard's row buffers: what a packed all-gather needs to move per rank."""
    if golden.q is None:
        return None
    rows, _ = fmt.row_views(golden.q)  # sizes only: no copy of a large golden
    total = 0
    for name, t in rows.items():
        entries = math.ceil(shard_rows / fmt.rows_per_entry[name])
        total += entries * (t[0].numel() if t.shape[0] else 0) * t.element_size()
    return total
