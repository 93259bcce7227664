"""What holds device memory at a case's peak (`qgather bench gpu --profile`, CUDA only).

The allocator's history (`torch.cuda.memory._record_memory_history`, Python stacks) is replayed
event by event: every allocation alive at the moment the allocated total is highest is listed,
grouped by where it was made (the innermost frame of qgather's own code, and the innermost frame
overall), largest first. The step tables of `memory_waypoints` say *when* the peak happens; this
says *what* it is made of, so a regression is located by reading one table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

MAX_ENTRIES = 2_000_000
PACKAGE_MARKERS = ("/qgather/",)  # the package, installed or in the checkout's harness/
# the bench's own instrumentation wraps the steps it times: never where a tensor was made
INSTRUMENTATION = tuple(f"/qgather/tools/bench/{name}.py" for name in ("memory_waypoints", "peak_anatomy",
                                                                   "case_bench"))
UNKNOWN = "(no Python frame)"


@dataclass(frozen=True)
class Holder:
    """Bytes alive at the peak that were allocated at one place."""

    where: str
    nbytes: int
    count: int


@dataclass(frozen=True)
class PeakAnatomy:
    """The highest allocated total the history saw (above what was allocated before it started,
    `before`), and the allocations alive at that moment, grouped by where they were made."""

    peak: int
    before: int
    holders: tuple[Holder, ...]

    def table(self, unit_bytes: int, unit: str, rows: int = 15) -> str:
        lines = [f"  what is allocated at the peak ({self.peak / unit_bytes:.2f} {unit} above the "
                 f"{self.before / unit_bytes:.2f} allocated before the case), by where it was allocated:"]
        lines += [f"    {h.nbytes / unit_bytes:6.2f}  x{h.count:<4d} {h.where}" for h in self.holders[:rows]]
        if len(self.holders) > rows:
            rest = sum(h.nbytes for h in self.holders[rows:])
            lines.append(f"    {rest / unit_bytes:6.2f}  {len(self.holders) - rows} more places")
        return "\n".join(lines)


def _frame_label(frame: Mapping) -> str:
    path = "/".join(str(frame.get("filename", "?")).split("/")[-2:])
    return f"{path}:{frame.get('line', '?')} {frame.get('name', '?')}"


def _is_own(filename: str) -> bool:
    return any(m in filename for m in PACKAGE_MARKERS) and not filename.endswith(INSTRUMENTATION)


def where_allocated(frames: Sequence[Mapping]) -> str:
    """'own-code frame <- innermost frame' for one allocation's stack (innermost first)."""
    if not frames:
        return UNKNOWN
    own = next((f for f in frames if _is_own(str(f.get("filename", "")))), None)
    inner = _frame_label(frames[0])
    if own is None or own is frames[0]:
        return inner if own is None else _frame_label(own)
    return f"{_frame_label(own)} <- {inner}"


def anatomy(trace: Sequence[Mapping], before: int = 0) -> PeakAnatomy:
    """Replay one device's trace (allocations and frees, in order) to the moment the bytes it
    allocated and had not yet freed are most; a block allocated before the trace began is not
    counted, nor its free (it is part of `before`, which the peak is reported above)."""
    live: dict[int, Mapping] = {}
    total = peak = 0
    at_peak: dict[int, Mapping] = {}
    for event in trace:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            live[addr] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)["size"]
    groups: dict[str, list[int]] = {}
    for event in at_peak.values():
        groups.setdefault(where_allocated(event.get("frames") or ()), []).append(event["size"])
    holders = sorted((Holder(where, sum(sizes), len(sizes)) for where, sizes in groups.items()),
                     key=lambda h: -h.nbytes)
    return PeakAnatomy(peak, before, tuple(holders))


@contextlib.contextmanager
def recorded(device: torch.device) -> Iterator[list[PeakAnatomy]]:
    """Record the allocator's history while the block runs; the list it yields gets the anatomy
    of the block's peak on `device` once the block ends."""
    found: list[PeakAnatomy] = []
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    try:
        yield found
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    found.append(anatomy(snapshot["device_traces"][index], before))
