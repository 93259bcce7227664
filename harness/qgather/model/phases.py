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
from collections.abc import Callable, Iterator


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


class PhaseTracker:
    """The phase this process is in, and how long it spent in each (one tracker per scenario run).

    The clock charges the time between two phase changes to the phase that ran, and a `labelled`
    block's time to its label (e.g. "golden"), so that a case's seconds can be read step by step.
    `sync` (e.g. torch.cuda.synchronize) runs before every reading, so that device work queued in a
    step is charged to that step and not to the next one that waits for it. It also notes the wall
    clock (time.time(): one clock for every process of a host) when each step first starts, so that
    ranks can be compared: a rank that reaches a collective first waits there for the last one.
    `memory` (a high-water mark of device memory, e.g. the CUDA allocator's peak; never lowered by the
    tracker) is read after each synced reading, off the clock, so that each rise of the mark is charged
    to the step that raised it.
    """

    def __init__(self, sync: Callable[[], None] | None = None, memory: Callable[[], int] | None = None) -> None:
        self._current = Phase.BUILD
        self._label = ""
        self._sync = sync
        self._memory = memory
        self._highest = 0
        self._high_water: dict[str, int] = {}
        self._since = time.perf_counter()
        self._seconds: dict[str, float] = {}
        self._started: dict[str, float] = {self._key: time.time()}

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
            self._lap(sync=False)  # a failed device may not synchronize: the error is what matters
            raise
        else:
            self._lap()
        finally:
            self._label = outer
            self._mark_start()

    def seconds(self, sync: bool = True) -> tuple[tuple[str, float], ...]:
        """(step, seconds) so far, in the order the steps first ran (sync=False: without waiting for
        the device, e.g. after an error)."""
        self._lap(sync)
        return tuple(self._seconds.items())

    def started(self) -> tuple[tuple[str, float], ...]:
        """(step, wall-clock second it first started), in the order the steps first ran."""
        return tuple(self._started.items())

    def high_water(self) -> tuple[tuple[str, int], ...]:
        """(step, bytes) for each step in which the memory mark rose, the highest reading charged to
        it, in the order the steps first raised it (empty without a memory reader)."""
        return tuple(self._high_water.items())

    @property
    def _key(self) -> str:
        return self._label or self._current.value

    def _mark_start(self) -> None:
        if self._key not in self._started:
            self._started[self._key] = time.time()

    def _lap(self, sync: bool = True) -> None:
        synced = sync and self._sync is not None
        if synced:
            self._sync()
        now = time.perf_counter()
        key = self._key
        self._seconds[key] = self._seconds.get(key, 0.0) + now - self._since
        self._since = now
        if synced and self._memory is not None:
            self._note_memory(key)
            self._since = time.perf_counter()  # the reading is the clock's own cost: no step's

    def _note_memory(self, key: str) -> None:
        # only on the laps that waited for the device: an error's lap (sync=False) asks the device nothing
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
