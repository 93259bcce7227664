"""Where a rank's case is right now, asked over a side channel while the case runs.

After one rank raised, the parent must tell a rank that is still working (it may raise the same
rejection a moment later) from one waiting in a collective for the rank that raised (it never
returns). A timer cannot: a loaded machine makes any grace period wrong. Each rank therefore runs
a small thread that answers "where are you?" with the innermost frames of its main thread, and the
parent counts a rank as waiting only when those frames are inside a collective.
"""

from __future__ import annotations

import faulthandler
import tempfile
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection

from qgather.runtime.held_collectives import HOLD_WAITS, waits_at_hold
from qgather.runtime.outcome import thread_frames
from qgather.runtime.protocol import (
    WHERE_QUERIES,
    WHERE_REPLIES,
    HeldWait,
    Whereabouts,
    WhereQuery,
    decode,
    encode,
)

FRAMES = 12  # innermost frames sent back
# A held collective's waits (runtime/agreement.py): the rank is outside the library's collective.
# (the side all-reduce of every rank; the store's keys of the members of a smaller group)
AGREEMENT_FILE = "runtime/agreement.py"
# Frames of these files mean: inside a torch.distributed collective (c10d, FSDP2's collectives).
COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py",
                    "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "torch/distributed/c10d_logger.py")

# Library functions that wait in a collective issued from native code, where no torch.distributed
# frame shows: TransformerEngine's current-scaling and NVFP4 quantizers all-reduce the amax inside
# tex.quantize (with_amax_reduction; seen on an H100: a rank waiting there for a rank that raised).
# Only the innermost frame counts: the rank is in the native call itself.
# A CUDA synchronize waits for every kernel queued on the device, NCCL's collective kernels included:
# on NCCL a rank whose peer raised before joining an all-gather waits there, not in a c10d frame
# (seen on 4 H100s: torch/cuda/__init__.py synchronize, for the whole case timeout).
NATIVE_COLLECTIVES = (
    ("transformer_engine/pytorch/tensor/float8_tensor.py", frozenset({"quantize_impl", "update_quantized"})),
    ("transformer_engine/pytorch/tensor/nvfp4_tensor.py", frozenset({"quantize_impl", "update_quantized"})),
    ("torch/cuda/__init__.py", frozenset({"synchronize"})),
    ("torch/cuda/streams.py", frozenset({"synchronize", "wait_event", "wait_stream"})),
)


#: Short facts the case leaves on its rank as it goes (e.g. what the pre-hook handed the all-gather),
#: read by the parent when the rank never answers: the evidence a HANG report shows per rank.
NOTES: dict[str, str] = {}
#: The held collective this rank waits at now (qgather.runtime.agreement), for the runner to release it.
#: Module state for the reason NOTES is: one per rank process, set by its main thread and read by the
#: whereabouts thread, which has no other object in common with the case.
_held_at: list[HeldWait | None] = [None]


def note(key: str, value: str) -> None:
    """Leave a fact on this rank for a HANG report (the latest value per key counts)."""
    NOTES[key] = value


def waiting_at(wait: HeldWait | None) -> None:
    """Say which held collective this rank waits at from now on (None: it left it)."""
    _held_at[0] = wait


def serve(conn: Connection) -> threading.Thread:
    """Answer every WhereQuery on `conn` with Whereabouts: the main thread's innermost frames and the
    case's notes (a daemon thread; anything but a WhereQuery raises ProtocolError and ends it)."""
    main = threading.main_thread().ident

    def loop() -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            decode(data, WHERE_QUERIES)
            reply = encode(_whereabouts(main))
            try:
                conn.send_bytes(reply)
            except (OSError, ValueError):
                return

    thread = threading.Thread(target=loop, name="qgather-whereabouts", daemon=True)
    thread.start()
    return thread


def ask(conn: Connection, timeout: float) -> Whereabouts:
    """The runner's side: where a rank's case is now, as `serve` answers (empty if no answer in `timeout` s)."""
    try:
        while conn.poll(0):  # the late answer to an earlier ask that timed out: not where the rank is now
            conn.recv_bytes()
        conn.send_bytes(encode(WhereQuery()))
        if not conn.poll(timeout):
            return Whereabouts()
        return decode(conn.recv_bytes(), WHERE_REPLIES)
    except (EOFError, OSError):
        return Whereabouts()


def _whereabouts(main: int | None) -> Whereabouts:
    """The main thread's frames and notes, and its held wait where it was the same before and after the
    frames were taken (a rank that moved on to the next held collective meanwhile says none)."""
    before = _held_at[0]
    frames = tuple(frames_of(main))
    held_at = before if _held_at[0] is before else None
    return Whereabouts(frames, dict(NOTES), held_at)


def frames_of(thread_id: int | None) -> list[str]:
    """The innermost FRAMES frames of a thread, as "file:line function" (oldest first).

    Read from a faulthandler dump, never through frame objects of the other thread: on CPython 3.11
    `sys._current_frames()` and `f_back` make a frame object for a frame of a running thread, and the
    allocation may start a collection whose finalizers hand the GIL to that thread; it then pops the
    frame, and the frame object is left pointing at a dead one. Reading it killed a rank by SIGSEGV
    (found by a core dump of the whereabouts thread in PyFrame_GetBack; tests/test_whereabouts.py
    replays it). The dump copies every thread's frames in C while holding the GIL, making no object."""
    if thread_id is None:
        return []
    frames = thread_frames(dump_stacks()).get(thread_id, [])
    return [f"{file}:{line} {func}" for file, line, func in reversed(frames[:FRAMES])]


def dump_stacks() -> str:
    """Every thread's stack, as faulthandler writes it (`outcome.thread_frames` reads it)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


# The rank's own barrier before each case: a rank still in it is late, not waiting for a failed one.
OWN_BARRIER = "runtime/rank.py"
OWN_BARRIERS = (OWN_BARRIER, "runtime/external.py")


def in_collective(frames: Sequence[str]) -> str | None:
    """The collective frame a rank's case is waiting in (innermost first), or None."""
    if any(own in f.replace("\\", "/") and f.endswith(" barrier") for f in frames for own in OWN_BARRIERS):
        return None
    held = next((f for f in reversed(frames) if _is_agreement_wait(f)), None)
    if held is not None:  # a held collective's wait: a collective's, though no torch frame may show
        return held.rsplit("/", 1)[-1]
    if frames and _in_native_collective(frames[-1]):
        return frames[-1].replace("\\", "/").rsplit("/", 1)[-1]
    for frame in reversed(frames):
        path = frame.replace("\\", "/")
        if any(name in path for name in COLLECTIVE_FILES):
            return frame.rsplit("/", 1)[-1]
    return None


def _in_native_collective(frame: str) -> bool:
    location, _, function = frame.replace("\\", "/").rpartition(" ")
    return any(path in location and function in functions for path, functions in NATIVE_COLLECTIVES)


def at_agreement(frames: Sequence[str]) -> bool:
    """Whether the main thread waits at a held collective (runtime/agreement.py), not inside one."""
    return any(_is_agreement_wait(f) for f in frames)


def _is_agreement_wait(frame: str) -> bool:
    return AGREEMENT_FILE in frame.replace("\\", "/") and frame.rpartition(" ")[2] in HOLD_WAITS


def held_back_notes(held_back: Mapping[int, str]) -> dict[int, dict[str, str]]:
    """Where each rank a failed rank's release let go had waited (as `evidence` says of a rank left behind)."""
    return {rank: {"main thread at": f"{collective} (held there by qgather until the failed rank released it)"}
            for rank, collective in held_back.items()}


def evidence(where: Whereabouts, left_behind: bool, asked_for: float) -> dict[str, str]:
    """What a rank noted, and for a live rank left behind (it never replied), where its main thread
    is: the evidence of where it waits (`asked_for`: the seconds it was given to answer)."""
    facts = dict(where.notes)
    if left_behind:
        facts["main thread at"] = _main_thread_at(where.frames, asked_for)
    return facts


def _main_thread_at(frames: Sequence[str], asked_for: float) -> str:
    if not frames:
        return f"(no answer within {asked_for:g} s: the rank holds the GIL)"
    held = waits_at_hold(f.rsplit(" ", 1)[-1] for f in frames)
    if held:
        return f"qgather's hold before {held}, waiting for every rank of its group to reach it"
    return frames[-1].replace("\\", "/").rsplit("/", 1)[-1]

