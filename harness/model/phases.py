"""Where in a case an error came from. Every exception that leaves a scenario carries the phase it
was raised in (`exc.qgather_phase`), so that a verdict can tell a refusal before any data moved
(a rejection, if the implementation declares the error type) from a failure after the gather.

Inside FSDP2's unshard the phase follows the subclass's own hooks: the pre-all-gather hook, then the
collective, then the post-all-gather hook (qgather.check.patches.hooks_moving_phase moves it there).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator


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


#: phases in which no byte of the weight has moved between ranks yet
BEFORE_DATA_MOVED = frozenset({Phase.BUILD.value, Phase.SHARD.value, Phase.PRE_HOOK.value})


class PhaseTracker:
    """The phase this process is in; one tracker per scenario run."""

    def __init__(self) -> None:
        self.current = Phase.BUILD

    @contextlib.contextmanager
    def at(self, phase: Phase) -> Iterator[None]:
        """The block runs in `phase` (it stays the current one after the block, until the next)."""
        self.current = phase
        yield

    @contextlib.contextmanager
    def tagging(self) -> Iterator[None]:
        """Tag any exception leaving the block with the phase it was raised in."""
        try:
            yield
        except BaseException as exc:
            if getattr(exc, "qgather_phase", None) is None:
                with contextlib.suppress(AttributeError):  # some built-in exceptions take no attributes
                    exc.qgather_phase = self.current.value
            raise


def phase_of(error: object) -> str:
    """The phase recorded on an exception or a RankError ("" when unknown)."""
    return getattr(error, "phase", None) or getattr(error, "qgather_phase", None) or ""
