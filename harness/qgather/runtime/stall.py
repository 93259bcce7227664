"""Ending a hung case on evidence instead of at its deadline: every rank handed the same all-gather
of the case a different number of bytes, and no rank's main thread has moved since.

Unequal inputs to one all-gather are a broken contract: gloo refuses them, NCCL waits on the device
for bytes that never come (a host thread then blocks wherever it next synchronizes, not in a c10d
frame, so `whereabouts.in_collective` cannot see it). Such a case used to spend its whole timeout
(30 s on the GPU job) before the HANG verdict it gets here about 10 s in (twice STALL_EVIDENCE_S:
the first look, then standing still): the verdict is the same, as is its evidence (the sizes, each
rank's place and stacks). Ranks that handed alike sizes, or any rank still moving, are left to the
deadline as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from qgather.runtime import gather_note
from qgather.runtime.protocol import Whereabouts

STALL_NOTE = "ended before its deadline: every rank stood still after unequal all-gather sizes"
STALL_EVIDENCE_S = 5.0  # every rank at one place this long, after handing the all-gather unequal sizes
LOOK_EVERY_S = 1.0  # how often a running case's ranks are asked where they are, once it has run STALL_EVIDENCE_S


@dataclass
class StallWatch:
    """Looks at a running case's ranks now and then; `stalled` once the evidence above holds."""

    world_size: int
    started: float = field(default_factory=time.monotonic)
    _next_look: float = 0.0
    _still_since: dict[int, tuple[tuple[str, ...], float]] = field(default_factory=dict)  # rank -> (frames, since)

    def stalled(self, pending: Collection[int], where: Callable[[int], Whereabouts]) -> bool:
        """Whether every rank is pending, at one place for STALL_EVIDENCE_S, after unequal all-gather sizes.
        `where(rank)` asks a rank where it is (only once the case has run STALL_EVIDENCE_S: the many shorter
        cases are never asked)."""
        now = time.monotonic()
        if len(pending) < self.world_size or now - self.started < STALL_EVIDENCE_S or now < self._next_look:
            return False
        self._next_look = now + LOOK_EVERY_S
        seen = {rank: where(rank) for rank in sorted(pending)}
        sizes = gather_note.unequal_sizes({rank: w.notes for rank, w in seen.items()})
        if len(sizes) < self.world_size or any(not w.frames for w in seen.values()):
            self._still_since.clear()
            return False
        for rank, w in seen.items():
            frames, since = self._still_since.get(rank, ((), now))
            self._still_since[rank] = (w.frames, since if frames == w.frames else now)
        return all(now - since >= STALL_EVIDENCE_S for _, since in self._still_since.values())
