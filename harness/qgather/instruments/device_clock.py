"""The step clock's view of a CUDA device (qgather.model.phases.DeviceClock): CUDA events recorded at
each step change, read once when the case's seconds are asked for.

A step's device work ends when an event recorded on the current stream at the step's end completes;
its time on the host's clock (time.perf_counter) is the anchor's host time plus the event's elapsed
time since the anchor, an event recorded on an idle device (after a synchronize) just before the
anchor's host time was read."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


class CudaClock:
    """Marks a CUDA device's queue (events on the current stream) and says when each mark was reached."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        torch.cuda.synchronize(device)
        self._anchor = self._event()
        self._anchor.synchronize()
        self._anchor_s = time.perf_counter()

    def mark(self) -> torch.cuda.Event:
        return self._event()

    def done_at(self, marks: Sequence[torch.cuda.Event]) -> list[float]:
        torch.cuda.synchronize(self._device)
        return [self._anchor_s + self._anchor.elapsed_time(mark) / 1e3 for mark in marks]

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event
