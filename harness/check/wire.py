"""What actually went over the wire during an unshard: the collective's bytes and the pre-hook's
outputs. A quantized gather moves about the format's packed size; a silent high-precision
fallback moves bf16/fp32 values (bug class 11), which no output comparison can see."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from qgather.model.records import WireSummary
from qgather.runtime import whereabouts

if TYPE_CHECKING:
    from qgather.formats import Format
    from qgather.impls.base import Implementation
    from qgather.model.case import ShardLayout
    from qgather.scenarios.core import Golden

# FSDP2 calls all_gather_single on newer torch and all_gather_into_tensor on older ones; one may
# call the other, so only the outermost call is counted.
_GATHER_FUNCTIONS = ("all_gather_single", "all_gather_into_tensor")


@dataclass
class WireLog:
    collective_bytes: int = 0
    collectives: int = 0
    hook_calls: int = 0
    hook_outputs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    _depth: int = 0

    def high_precision_elements(self) -> int:
        """Elements of >= 16-bit floating dtypes handed to the gather by the pre-hook."""
        total = 0
        for dtype_name, shape in self.hook_outputs:
            dtype = getattr(torch, dtype_name)
            if dtype.is_floating_point and torch.finfo(dtype).bits >= 16:
                total += int(torch.Size(shape).numel())
        return total


@contextlib.contextmanager
def record_wire(param_types: tuple[type, ...] = ()) -> Iterator[WireLog]:
    """Count all-gather bytes and record the pre-hook outputs of `param_types` while active."""
    log = WireLog()
    restore: list[tuple[object, str, object]] = []

    def counting(original):
        @functools.wraps(original)
        def wrapper(output, input, *args, **kwargs):
            if log._depth == 0:
                log.collectives += 1
                log.collective_bytes += input.numel() * input.element_size()
                whereabouts.note("all-gather", f"{input.numel() * input.element_size()} bytes from this rank")
            log._depth += 1
            try:
                return original(output, input, *args, **kwargs)
            finally:
                log._depth -= 1

        return wrapper

    def recording(original):
        @functools.wraps(original)  # FSDP2 inspects the hook's signature
        def pre_all_gather(self, *args, **kwargs):
            inputs, metadata = original(self, *args, **kwargs)
            log.hook_calls += 1
            outputs = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in inputs]
            log.hook_outputs.extend(outputs)
            whereabouts.note("pre-hook handed", ", ".join(f"{d}{list(s)}" for d, s in outputs))
            return inputs, metadata

        return pre_all_gather

    for name in _GATHER_FUNCTIONS:
        if hasattr(dist, name):
            restore.append((dist, name, getattr(dist, name)))
            setattr(dist, name, counting(getattr(dist, name)))
    for cls in param_types:
        original = cls.__dict__.get("fsdp_pre_all_gather")
        if original is None:
            original = getattr(cls, "fsdp_pre_all_gather", None)
            restore.append((cls, "fsdp_pre_all_gather", None))
        else:
            restore.append((cls, "fsdp_pre_all_gather", original))
        if original is not None:
            cls.fsdp_pre_all_gather = recording(original)
    try:
        yield log
    finally:
        for owner, name, original in reversed(restore):
            if original is None:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)


def summarize_wire(wire: WireLog, fmt: Format, weight: torch.Tensor, shards: ShardLayout, golden: Golden,
                   impl: Implementation) -> WireSummary:
    """What the case moved, beside what its packed shard needed and what the implementation may move."""
    padded_rows = shards.chunk * shards.inner_rows
    # Shard(1) (qgather.model.case.ColumnShardLayout): every row, a 1/ws slice of the columns
    col_fraction = (shards.col_chunk, weight.shape[-1]) if hasattr(shards, "col_chunk") else (1, 1)
    packed = packed_shard_bytes(fmt, golden, padded_rows)
    summary = WireSummary(collective_bytes=wire.collective_bytes, collectives=wire.collectives,
                          hook_calls=wire.hook_calls, hook_outputs=list(wire.hook_outputs),
                          high_precision_elements=wire.high_precision_elements(),
                          shard_numel=padded_rows * weight.shape[-1] * col_fraction[0] // col_fraction[1],
                          param_itemsize=weight.element_size(),
                          packed_bytes=None if packed is None else packed * col_fraction[0] // col_fraction[1])
    if summary.packed_bytes:
        summary.wire_mode, summary.allowed_bytes = impl.wire_allowance(fmt.name, tuple(weight.shape), shards,
                                                                       summary.packed_bytes)
    return summary


def packed_shard_bytes(fmt: Format, golden: Golden, shard_rows: int) -> int | None:
    """Bytes of one shard's row buffers: what a packed all-gather needs to move per rank."""
    if golden.q is None:
        return None
    rows, _ = fmt.to_rows(golden.q)
    total = 0
    for name, t in rows.items():
        entries = math.ceil(shard_rows / fmt.rows_per_entry[name])
        total += entries * (t[0].numel() if t.shape[0] else 0) * t.element_size()
    return total
