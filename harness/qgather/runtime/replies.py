"""What the ranks of a pool said (or did) in answer to one message, and when the pool looks again.

One `Replies` per exchange (a case, a start, a health check): who has not answered yet, each rank's
result, error or exit code, and the schedule of the pool's waits (qgather.runtime.pool).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from qgather.runtime import protocol
from qgather.runtime.outcome import OutcomeStatus, RankError

# After a first failure, how often the parent asks the other ranks where they are; a rank counts
# as waiting for the failed one only when seen inside a collective of its case on every look for
# WAIT_EVIDENCE_S (a loaded machine can keep a rank a moment in a collective it is leaving).
WHERE_POLL_S = 0.1
WAIT_EVIDENCE_S = 1.0
# The longest one wait for replies lasts: a Ctrl-C/SIGTERM the kernel hands to another thread runs its
# Python handler only once the main thread runs Python again (a hung case: not until its timeout).
SIGNAL_CHECK_S = 0.5


@dataclass
class Replies:
    """What the ranks said (or did) in answer to one message; `accepts`: the replies it may get."""

    world_size: int
    accepts: tuple[type, ...] = protocol.RANK_REPLYING
    results: list[Any] = field(default_factory=list)
    errors: dict[int, RankError] = field(default_factory=dict)
    exit_codes: dict[int, int] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    first_failure_at: float | None = None
    waiting: dict[int, tuple[str, float]] = field(default_factory=dict)  # rank -> (collective frame, since)
    stalled: str = ""  # the note of a stall's evidence that ended it (qgather.runtime.stall), not the deadline
    held: dict[int, protocol.HeldWait] = field(default_factory=dict)  # rank -> the held collective it was
    # last seen waiting at (qgather.runtime.agreement)
    held_back: dict[int, str] = field(default_factory=dict)  # rank -> the collective it left its case before
    released: set[protocol.HeldWait] = field(default_factory=set)  # the waits the answered ranks were asked
    # to join (Release): each once
    start_phases: dict[int, tuple[tuple[str, float], ...]] = field(default_factory=dict)  # rank -> Ready.phases

    def __post_init__(self) -> None:
        self.results = [None] * self.world_size
        self.pending = set(range(self.world_size))

    def slowest_start_phases(self) -> tuple[tuple[str, float], ...]:
        """Each phase of the ranks' start (Ready.phases) as long as its slowest rank took ("rank: <phase>")."""
        slowest: dict[str, float] = {}
        for rank_phases in self.start_phases.values():
            for phase, seconds in rank_phases:
                slowest[phase] = max(slowest.get(phase, 0.0), seconds)
        return tuple((f"rank: {phase}", seconds) for phase, seconds in slowest.items())

    def releasable(self) -> list[protocol.HeldWait]:
        """The held waits that only the ranks which answered can end, not asked yet: every member of the
        wait's group either answered or waits at it, and some answered. (A member still in the case
        elsewhere may yet come; where every member is there, the wait ends by itself.) The side
        all-reduce of every rank is one only once every rank still in the case waits at it."""
        waits = set(self.held.values()) - self.released
        return sorted(wait for wait in waits
                      if all(self.held.get(member) == wait for member in wait.ranks if member in self.pending)
                      and not self.pending.issuperset(wait.ranks))

    def failed(self) -> None:
        """A rank raised or died: from now on, look where the others are."""
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def wait_until(self, deadline: float) -> float:
        """The end of the next wait: before any failure, the deadline (at most SIGNAL_CHECK_S away);
        after one, the next look at where the others are."""
        step = SIGNAL_CHECK_S if self.first_failure_at is None else WHERE_POLL_S
        return min(deadline, time.monotonic() + step)

    @property
    def status(self) -> OutcomeStatus:
        """A death wins over an error, an error over ranks that never answered."""
        if self.exit_codes:
            return OutcomeStatus.CRASH
        if self.errors:
            return OutcomeStatus.ERROR
        return OutcomeStatus.HANG if self.pending else OutcomeStatus.OK
