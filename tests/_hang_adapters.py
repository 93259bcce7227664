"""External adapters (loaded by `qgather case tests._hang_adapters:<name>:...`) that hang on purpose.

Each hang is real and bounded only by the case timeout; `QGATHER_TEST_MARKER_DIR`, when set, gets
one file per rank that reached the hang, so a test can wait for it instead of sleeping.
"""

from __future__ import annotations

import os
import threading

import torch.distributed as dist

from qgather.impls.reference import ReferenceImplementation


def _mark_reached() -> None:
    where = os.environ.get("QGATHER_TEST_MARKER_DIR")
    if where:
        with open(os.path.join(where, f"rank{dist.get_rank()}.{os.getpid()}"), "w"):
            pass


def wait_for_a_peer_that_never_comes() -> None:
    _mark_reached()
    never = threading.Event()
    while not never.wait(0.05):  # a polling loop in adapter code, as a buggy handshake would be
        pass


class EndsWell(ReferenceImplementation):
    """The reference itself, under this module's name: what warms a pool's imports before a hang test."""


class HangsInAdapter(ReferenceImplementation):
    """Every rank spins in its own code, outside any collective."""

    def make_param(self, fmt, weight):
        wait_for_a_peer_that_never_comes()
        return super().make_param(fmt, weight)


class SkipsACollective(ReferenceImplementation):
    """Rank 0 skips a barrier the other ranks enter: they wait in it, rank 0 waits in FSDP's gather."""

    def make_param(self, fmt, weight):
        _mark_reached()
        if dist.get_rank() != 0:
            dist.barrier()
        return super().make_param(fmt, weight)


def _note_gather_then_stand_still(nbytes: int) -> None:
    """A rank as an NCCL all-gather of `nbytes` that never completes leaves it on the host: the gather
    noted, the main thread blocked at one place (outside any c10d frame) until the case is given up."""
    from qgather.runtime import gather_note, whereabouts

    whereabouts.note(gather_note.KEY, gather_note.text(nbytes, 1))
    threading.Event().wait()


def unequal_gather_then_stand_still(ctx) -> None:
    _note_gather_then_stand_still(1024 * (dist.get_rank() + 1))


def equal_gather_then_stand_still(ctx) -> None:
    _note_gather_then_stand_still(1024)
