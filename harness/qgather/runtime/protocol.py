"""The closed set of messages between a pool's runner and its ranks, and their one encoding.

Every message is a frozen dataclass, and each channel accepts a fixed family of them:

    runner -> rank   (a rank's case pipe)        RunCase | HealthCheck | Stop
    rank -> runner   (the same pipe, back)       Ready | StartFailed       while the pool starts
                                                 Returned | Raised         after RunCase or HealthCheck
    runner -> rank   (the whereabouts pipe)      WhereQuery
    rank -> runner   (the whereabouts pipe)      Whereabouts
    job rank -> job  (a launched job's store)    RankReport

`encode` pickles at HIGHEST_PROTOCOL with plain `pickle`, not multiprocessing's ForkingPickler, so
tensors travel inline instead of through torch's shared-memory file-descriptor passing (which would
need a resource-sharer thread and socket in every process). `decode` takes the family its channel
accepts and raises `ProtocolError` on anything else: a receiver dispatches on the message's class
and never guesses (pytest-xdist's `process_from_remote` does the same with its events).
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from qgather.errors import HarnessFault
from qgather.runtime.outcome import RankError

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


class ProtocolError(HarnessFault):
    """A message outside the closed set its channel accepts: a bug in the runtime, never a case's doing."""


class UnreadableMessage(ProtocolError):
    """Bytes that do not unpickle at all (e.g. a result whose class the receiver cannot import).

    `cause` is the exception unpickling raised: the receiver may report it as the sender's error.
    """

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


# -- runner -> rank ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunCase:
    """Run one case on every rank: `blob` is `encode_case(fn, args)`, unpickled on the rank so that
    a function the rank cannot import is that case's error, not the pool's."""

    case_id: str
    seed: int
    blob: bytes


@dataclass(frozen=True)
class HealthCheck:
    """After a failed case: one collective every rank must complete before the pool is trusted again."""

    sequence: int


@dataclass(frozen=True)
class Stop:
    """Leave the process group and exit (a graceful shutdown)."""


@dataclass(frozen=True, order=True)
class HeldWait:
    """A held collective's wait (qgather.runtime.agreement): the pool's ranks of the collective's group
    (sorted; every rank: the side all-reduce) and the group's count of held collectives so far in the case."""

    ranks: tuple[int, ...]
    sequence: int


@dataclass(frozen=True)
class Release:
    """To a rank that answered its case while others still wait at held collectives of its groups
    (qgather.runtime.agreement): join each of those `waits` once, saying it will not come."""

    waits: tuple[HeldWait, ...]


# -- rank -> runner ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The rank joined the process group and serves cases; `phases`: the seconds its start took, step
    by step (("process group", 1.2), ...), for the pool's start to be read phase by phase."""

    pid: int
    phases: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class StartFailed:
    """The rank could not join the process group; it exits after sending this."""

    error: RankError


@dataclass(frozen=True)
class Returned:
    """The case (or health check) returned on this rank; tensors in `value` are on the CPU."""

    value: Any


@dataclass(frozen=True)
class Raised:
    """The case (or health check) raised on this rank; the rank keeps serving."""

    error: RankError


@dataclass(frozen=True)
class HeldBack:
    """The case left this rank before `collective`, which another rank that failed would never join
    (qgather.runtime.agreement). The rank keeps serving."""

    collective: str


# -- the whereabouts side channel -------------------------------------------------------------


@dataclass(frozen=True)
class WhereQuery:
    """Where is your case now? (answered by a rank's whereabouts thread while the case runs)"""


@dataclass(frozen=True)
class Whereabouts:
    """The innermost frames of a rank's main thread ("file:line function", oldest first), the
    facts its case noted so far (`qgather.runtime.whereabouts.note`), and the held collective it
    waits at (None: none)."""

    frames: tuple[str, ...] = ()
    notes: Mapping[str, str] = field(default_factory=dict)
    held_at: HeldWait | None = None


# -- a launched job's store -------------------------------------------------------------------


class ReportState(str, enum.Enum):
    """How a job rank's part in one case ended, as it posts it to the job's store:

    - ``DONE``: the case came back on this rank (returned or raised: `RankReport.error` says which).
    - ``IDLE``: this rank is not a member of the case's group; it only takes part in agreeing.
    - ``HANG``: the case did not come back by the timeout; `stacks` holds every thread's stack.
    - ``WAITING``: a peer failed and this rank's case sat inside a collective for WAIT_EVIDENCE_S:
      it waits for that peer and will never return; `stacks` holds every thread's stack.
    """

    DONE = "done"
    IDLE = "idle"
    HANG = "hang"
    WAITING = "waiting"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RankReport:
    """One job rank's report of one case (ExternalPool): the first one posted counts."""

    state: ReportState
    job_rank: int
    host: str
    elapsed: float
    result: Any = None
    error: RankError | None = None
    stacks: str = ""


RunnerMessage = RunCase | HealthCheck | Stop | Release
RankMessage = Ready | StartFailed | Returned | Raised | HeldBack

# The families each channel accepts.
RUNNER_TO_RANK: tuple[type, ...] = (RunCase, HealthCheck, Stop, Release)
RANK_STARTING: tuple[type, ...] = (Ready, StartFailed)
RANK_REPLYING: tuple[type, ...] = (Returned, Raised, HeldBack)
WHERE_QUERIES: tuple[type, ...] = (WhereQuery,)
WHERE_REPLIES: tuple[type, ...] = (Whereabouts,)
JOB_REPORTS: tuple[type, ...] = (RankReport,)
MESSAGES: tuple[type, ...] = (*RUNNER_TO_RANK, *RANK_STARTING, *RANK_REPLYING, *WHERE_QUERIES, *WHERE_REPLIES,
                              *JOB_REPORTS)


def encode(message: Any) -> bytes:
    """The bytes of one protocol message (pickling errors of what it carries propagate unchanged).

    Raises ProtocolError for anything that is not one of the protocol's messages.
    """
    if type(message) not in MESSAGES:
        raise ProtocolError(f"not a runtime protocol message: {type(message).__qualname__}")
    return pickle.dumps(message, protocol=PICKLE_PROTOCOL)


def decode(data: bytes, accepted: tuple[type, ...]) -> Any:
    """The message in `data`, which must be one of the classes in `accepted` (the channel's family).

    Raises UnreadableMessage when the bytes do not unpickle, ProtocolError for any other object.
    """
    try:
        message = pickle.loads(data)
    except Exception as exc:
        raise UnreadableMessage(f"{type(exc).__name__}: {exc}", exc) from exc
    if type(message) not in accepted:
        expected = " | ".join(cls.__name__ for cls in accepted)
        raise ProtocolError(f"expected {expected}, got {type(message).__qualname__}")
    return message


def send(conn: Connection, data: bytes) -> bool:
    """Send one encoded message down a pipe; False when the other end is gone (a dead rank or runner)."""
    try:
        conn.send_bytes(data)
        return True
    except OSError:  # BrokenPipeError, ConnectionResetError, a closed handle
        return False


def encode_case(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """A case function and its arguments as RunCase's blob; one-line TypeError if they cannot travel."""
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {type(fn).__name__}")
    try:
        return pickle.dumps((fn, args), protocol=PICKLE_PROTOCOL)
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"cannot send case {name} to the ranks (fn must be a module-level function "
                        f"and args picklable): {exc}") from None


def decode_case(blob: bytes) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The case function and arguments of a RunCase blob (on the rank: its import errors are the case's)."""
    fn, args = pickle.loads(blob)
    return fn, args
