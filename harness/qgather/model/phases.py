"""Where in a case an error came from. Every exception that leaves a scenario carries the phase it
was raised in (`exc.qgather_phase`), so that a verdict can tell a refusal before any data moved
(a rejection, if the implementation declares the error type) from a failure after the gather.

Inside FSDP2's unshard the phase follows the subclass's own hooks: the pre-all-gather hook, then the
collective, then the post-all-gather hook (qgather.instruments.patches.hooks_moving_phase moves it there).
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol


class Phase(str, enum.Enum):
    """A step of a case on a rank; its value is what reports print ("raised in the <value>")."""

    BUILD = "build/quantize"
    SHARD = "shard"
    PRE_HOOK = "pre-all-gather hook"
    COLLECTIVE = "collective"
    POST_HOOK = "post-all-gather hook"
    INSPECTION = "inspection"
    FORWARD = "forward"
    STEP = "optimizer step"
    SAVE = "checkpoint save"
    LOAD = "checkpoint load"
    COMPILE = "compiled forward"


class Step(str, enum.Enum):
    """A labelled step of a case's build and inspection (PhaseTracker.labelled): what its seconds
    are charged to, in timings.md and `qgather bench gpu`."""

    TWIN = "one-device twin"
    GOLDEN = "golden"
    SHARDED_MODULE = "sharded module"
    LIBRARY_FORWARD = "library forward"
    RESHARD = "reshard"  # FSDP2's reshard after the first inspection: the library's, not the inspection's


#: phases in which no byte of the weight has moved between ranks yet
BEFORE_DATA_MOVED = frozenset({Phase.BUILD.value, Phase.SHARD.value, Phase.PRE_HOOK.value})


class DeviceClock(Protocol):
    """A device that runs queued work asynchronously (CUDA), as the step clock reads it."""

    def mark(self) -> object:
        """A point in the device's queue: the work queued so far."""

    def done_at(self, marks: Sequence[object]) -> list[float]:
        """When (time.perf_counter's seconds) the device had finished the work before each mark;
        waits for the device once."""


@dataclass
class _Lap:
    """One stretch of host time charged to `key`; `mark`: the device's queue at its end (None: none
    read, e.g. an error's lap); `done`: when the device had done the work before the mark, once read."""

    key: str
    start: float
    end: float
    mark: object | None
    done: float | None = None


class PhaseTracker:
    """The phase this process is in, and how long it spent in each (one tracker per scenario run).

    The clock charges the time between two phase changes to the phase that ran, and a `labelled`
    block's time to its label (e.g. "golden"), so that a case's seconds can be read step by step.
    With a `device` (DeviceClock, e.g. CUDA's events) each change also marks the device's queue, and
    a step ends when the host has left it and the device has finished the work queued in it, so that
    device work queued in a step is charged to that step and not to the next one. The device is not
    waited for at each change (a synchronize there kept the host from queueing the next step while the
    device ran this one: the case took the sum of both): the marks are read once, when the seconds
    are asked for. It also notes the wall clock (time.time(): one clock for every process of a host)
    when each step first starts (with a device: once the device had finished the step before), so
    that ranks can be compared: a rank that reaches a collective first waits there for the last one.
    `memory` (a high-water mark of device memory, e.g. the CUDA allocator's peak, which counts an
    allocation when it is queued; never lowered by the tracker) is read at each change, off the
    clock, so that each rise of the mark is charged to the step that raised it.
    """

    def __init__(self, device: DeviceClock | None = None, memory: Callable[[], int] | None = None) -> None:
        self._current = Phase.BUILD
        self._label = ""
        self._device = device
        self._memory = memory
        self._highest = 0
        self._high_water: dict[str, int] = {}
        self._since = time.perf_counter()
        self._laps: list[_Lap] = []
        self._first: dict[str, tuple[float, int]] = {}  # step -> (wall clock at its first start, its first lap)
        self._mark_start()

    @property
    def current(self) -> Phase:
        return self._current

    @current.setter
    def current(self, phase: Phase) -> None:
        self._lap()
        self._current = phase
        self._mark_start()

    @contextlib.contextmanager
    def at(self, phase: Phase) -> Iterator[None]:
        """The block runs in `phase` (it stays the current one after the block, until the next)."""
        self.current = phase
        yield

    @contextlib.contextmanager
    def labelled(self, label: Step) -> Iterator[None]:
        """The block's time is charged to `label`, whatever phases it passes through (the phase an error
        is tagged with is unchanged)."""
        self._lap()
        outer, self._label = self._label, label.value
        self._mark_start()
        try:
            yield
        except BaseException:
            self._lap(device=False)  # a failed device may not answer: the error is what matters
            raise
        else:
            self._lap()
        finally:
            self._label = outer
            self._mark_start()

    def seconds(self, sync: bool = True) -> tuple[tuple[str, float], ...]:
        """(step, seconds) so far, in the order the steps first ran. sync: the device's marks are read
        (waiting for it once); False: host time only, without asking the device (e.g. after an error)."""
        self._lap(device=sync)
        seconds: dict[str, float] = {}
        for lap, (start, end) in zip(self._laps, self._spans(sync), strict=True):
            seconds[lap.key] = seconds.get(lap.key, 0.0) + end - start
        return tuple(seconds.items())

    def started(self) -> tuple[tuple[str, float], ...]:
        """(step, wall-clock second it first started), in the order the steps first ran: with a
        device whose marks were read (`seconds`), once the device had finished the step before."""
        spans = self._spans(any(lap.done is not None for lap in self._laps))
        started = {}
        for key, (wall, index) in self._first.items():
            delay = spans[index][0] - self._laps[index].start if index < len(self._laps) else 0.0
            started[key] = wall + delay
        return tuple(started.items())

    def high_water(self) -> tuple[tuple[str, int], ...]:
        """(step, bytes) for each step in which the memory mark rose, the highest reading charged to
        it, in the order the steps first raised it (empty without a memory reader)."""
        return tuple(self._high_water.items())

    @property
    def _key(self) -> str:
        return self._label or self._current.value

    def _mark_start(self) -> None:
        if self._key not in self._first:
            self._first[self._key] = (time.time(), len(self._laps))

    def _lap(self, device: bool = True) -> None:
        now = time.perf_counter()
        asked = device and self._device is not None
        self._laps.append(_Lap(self._key, self._since, now, self._device.mark() if asked else None))
        self._since = now
        if asked and self._memory is not None:
            self._note_memory(self._key)
            self._since = time.perf_counter()  # the reading is the clock's own cost: no step's

    def _spans(self, with_device: bool) -> list[tuple[float, float]]:
        """Each lap's (start, end): it starts when the host started it and the step before had ended,
        and ends when the host left it and (with_device) the device had done the work queued in it."""
        if with_device:
            self._read_device()
        spans, ended = [], float("-inf")
        for lap in self._laps:
            start = max(lap.start, ended)
            ended = max(start, lap.end, lap.done if with_device and lap.done is not None else lap.end)
            spans.append((start, ended))
        return spans

    def _read_device(self) -> None:
        """Each marked lap's `done`, for the marks not read yet: one wait for the device."""
        unread = [lap for lap in self._laps if lap.mark is not None and lap.done is None]
        if not unread:
            return
        for lap, at in zip(unread, self._device.done_at([lap.mark for lap in unread]), strict=True):
            lap.done = at

    def _note_memory(self, key: str) -> None:
        # only on the laps that marked the device: an error's lap asks the device nothing
        reading = self._memory()
        if reading > self._highest:
            self._highest = reading
            self._high_water[key] = reading

    @contextlib.contextmanager
    def tagging(self) -> Iterator[None]:
        """Tag any exception leaving the block with the phase it was raised in and the seconds each
        step took until then (a failing case's time is read step by step too)."""
        try:
            yield
        except BaseException as exc:
            if getattr(exc, "qgather_phase", None) is None:
                with contextlib.suppress(AttributeError):  # some built-in exceptions take no attributes
                    exc.qgather_phase = self.current.value
                    exc.qgather_seconds = self.seconds(sync=False)
            raise


def phase_of(error: object) -> str:
    """The phase recorded on an exception or a RankError ("" when unknown)."""
    return getattr(error, "phase", None) or getattr(error, "qgather_phase", None) or ""
