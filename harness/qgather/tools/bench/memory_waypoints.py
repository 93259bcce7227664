"""Which step of a case holds the peak of device memory (`qgather bench gpu --profile`).

Wraps named functions for the duration of one call and records, per function, the highest device
memory allocated while it ran (nested calls included), in units the caller chooses. CUDA only:
torch's allocator statistics are what is read; the peak counter is reset at each entry and folded
back into every enclosing call's peak at each exit, so nesting stays correct. `settle` gives the
bytes a case's peak is measured above (what earlier runs left), `wrapping` the patching itself.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Waypoints:
    device: torch.device
    baseline: int = 0  # bytes allocated before the recording started: peaks are reported above it
    peaks: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    _running: list[int] = field(default_factory=list)

    def enter(self) -> None:
        if self._running:
            self._running[-1] = max(self._running[-1], torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self._running.append(torch.cuda.memory_allocated(self.device))

    def leave(self, name: str) -> None:
        peak = max(self._running.pop(), torch.cuda.max_memory_allocated(self.device))
        self.peaks[name] = max(self.peaks.get(name, 0), peak - self.baseline)
        self.calls[name] = self.calls.get(name, 0) + 1
        if self._running:
            self._running[-1] = max(self._running[-1], peak)
        torch.cuda.reset_peak_memory_stats(self.device)

    def table(self, unit_bytes: int, unit: str) -> str:
        rows = sorted(self.peaks.items(), key=lambda kv: -kv[1])
        return "\n".join([f"  peak device memory while each step ran (above what was allocated before), in {unit}:"] +
                         [f"    {peak / unit_bytes:6.2f}  {name} (x{self.calls[name]})" for name, peak in rows])


@contextlib.contextmanager
def recording(device: torch.device, targets: Sequence[tuple[object, str]], baseline: int = 0) -> Iterator[Waypoints]:
    """Record the peaks of `targets` ((owner, attribute name): a module's function or a class's
    method) while the block runs; the originals are restored after it."""
    points = Waypoints(device, baseline)
    with wrapping(targets, lambda label, fn: _wrapped(points, label, fn)):
        yield points


@contextlib.contextmanager
def wrapping(targets: Sequence[tuple[object, str]], wrap: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """Each target ((owner, attribute name)) replaced by wrap(its label, the original) while the block
    runs, the label "<owner's name>.<name>"; the originals are restored after it."""
    originals = [(owner, name, getattr(owner, name), name in vars(owner)) for owner, name in targets]
    for owner, name, original, _ in originals:
        setattr(owner, name, wrap(f"{getattr(owner, '__name__', owner)}.{name}", original))
    try:
        yield
    finally:
        for owner, name, original, own in reversed(originals):
            if own:
                setattr(owner, name, original)
            else:  # inherited: remove the wrapper so that lookup finds the base's again
                delattr(owner, name)


def _wrapped(points: Waypoints, label: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        points.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            points.leave(label)

    return call


def settle(device: torch.device) -> int:
    """Free what earlier runs left in reference cycles (a sharded module's hooks) and start the peak
    counter; returns the bytes still allocated, which the case's peak is measured above."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)
