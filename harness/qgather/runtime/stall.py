"""Ending a hung case on evidence instead of at its deadline: every rank handed the same all-gather
of the case a different number of bytes, and no rank's main thread has moved since.

Unequal inputs to one all-gather are a broken contract: gloo refuses them, NCCL waits on the device
for bytes that never come (a host thread then blocks wherever it next synchronizes, not in a c10d
frame, so `whereabouts.in_collective` cannot see it). Such a case used to spend its whole timeout
(30 s on the GPU job) before the HANG verdict it gets here about 10 s in (twice STALL_EVIDENCE_S:
the first look, then standing still): the verdict is the same, as is its evidence (the sizes, each
rank's place and stacks). Ranks that handed alike sizes, or any rank still moving, are left to the
deadline as before.

The same goes for ranks split at a hold (runtime/agreement.py): some wait at the hold before a
collective of every rank while the others stand inside a held collective that the hold had let them
into. The hold lets a rank in only once every rank has come to one, so a rank still waiting at the
next one has left (or skipped inside native code, as TE's amax reduction does on a zero-row rank) the
collective the others are in: they wait for it, and it for them. On the 1 x H200 gate such cases
spent their whole 30 s timeout (docs/gpu-results.md, 2026-11-29, morning).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from qgather.runtime import gather_note
from qgather.runtime.held_collectives import inside_held, waits_at_hold
from qgather.runtime.protocol import Whereabouts

STALL_NOTE = "ended before its deadline: every rank stood still after unequal all-gather sizes"
SPLIT_NOTE = ("ended before its deadline: every rank stood still, some at qgather's hold before a collective, "
              "the others inside the collective it had let them into")
STALL_EVIDENCE_S = 5.0  # every rank at one place this long, after handing the all-gather unequal sizes
LOOK_EVERY_S = 1.0  # how often a running case's ranks are asked where they are, once it has run STALL_EVIDENCE_S


@dataclass
class StallWatch:
    """Looks at a running case's ranks now and then; `stalled` once the evidence above holds."""

    world_size: int
    started: float = field(default_factory=time.monotonic)
    _next_look: float = 0.0
    _still_since: dict[int, tuple[tuple[str, ...], float]] = field(default_factory=dict)  # rank -> (frames, since)

    def stalled(self, pending: Collection[int], where: Callable[[int], Whereabouts]) -> str:
        """The note to end the case with ("" while not stalled): every rank pending, at one place for
        STALL_EVIDENCE_S, after unequal all-gather sizes (STALL_NOTE) or split at a hold (SPLIT_NOTE).
        `where(rank)` asks a rank where it is (only once the case has run STALL_EVIDENCE_S: the many shorter
        cases are never asked)."""
        now = time.monotonic()
        if len(pending) < self.world_size or now - self.started < STALL_EVIDENCE_S or now < self._next_look:
            return ""
        self._next_look = now + LOOK_EVERY_S
        seen = {rank: where(rank) for rank in sorted(pending)}
        note = _evidence(seen, self.world_size)
        if not note or any(not w.frames for w in seen.values()):
            self._still_since.clear()
            return ""
        for rank, w in seen.items():
            frames, since = self._still_since.get(rank, ((), now))
            self._still_since[rank] = (w.frames, since if frames == w.frames else now)
        return note if all(now - since >= STALL_EVIDENCE_S for _, since in self._still_since.values()) else ""


def _evidence(seen: dict[int, Whereabouts], world_size: int) -> str:
    """Which stall the ranks' places show, if any (the note that says so)."""
    if len(gather_note.unequal_sizes({rank: w.notes for rank, w in seen.items()})) == world_size:
        return STALL_NOTE
    functions = {rank: [f.rsplit(" ", 1)[-1] for f in w.frames] for rank, w in seen.items()}
    at_hold = [rank for rank, names in functions.items() if waits_at_hold(names)]
    inside = [rank for rank, names in functions.items() if inside_held(names)]
    return SPLIT_NOTE if at_hold and inside and len(at_hold) + len(inside) == world_size else ""

