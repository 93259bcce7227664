"""What a case run returns: per-rank results, errors, stacks and exit codes, and its one-line headline.

`RankError` is an exception as it crosses a process boundary, `OutcomeStatus` how a case ended,
`CaseOutcome` the whole verdict-neutral record, and `same_error_on_every_rank` the one place that
decides whether every rank refused alike. The rest reads faulthandler dumps: which thread runs the
case (`case_frames`) and where a rank is blocked (`where_blocked`).
"""

from __future__ import annotations

import enum
import os
import re
import signal
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from qgather.errors import qualified_name
from qgather.runtime import gather_note
from qgather.runtime.held_collectives import waits_at_hold

# The rank-side function that runs a case (runtime/rank.py, runtime/external.py): the thread with
# this frame in a stack dump is the case's thread.
CASE_FRAME = "run_case_on_rank"

_NUMBER = re.compile(r"\d+")

_THREAD_HEADER = re.compile(r"^(?P<kind>Current thread|Thread) 0x(?P<id>[0-9a-fA-F]+)")
_FATAL = re.compile(r"^Fatal Python error: (?P<what>.+)$", re.MULTILINE)  # a fatal signal's dump, not SIGTERM's
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # "[.../pair.cc:537] " from C++
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _raised_at(exc: BaseException | None, seen: frozenset[int] = frozenset()) -> tuple:
    """What an exception's formatted traceback is made of: its type, message and frames, and its
    cause's and context's likewise (an exception already in the chain ends it, as in traceback's
    formatting: a chain can be a cycle)."""
    if exc is None or id(exc) in seen:
        return ()
    seen = seen | {id(exc)}
    frames = tuple((tb.tb_frame.f_code.co_filename, tb.tb_lineno) for tb in _tracebacks(exc.__traceback__))
    return (type(exc), str(exc), frames, _raised_at(exc.__cause__, seen),
            _raised_at(exc.__context__, seen) if not exc.__suppress_context__ else ())


def _tracebacks(tb: Any) -> Iterator[Any]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


@dataclass(frozen=True)
class RankError:
    """An exception raised by `fn` (or by the runtime around it) on one rank."""

    rank: int
    type_name: str
    message: str
    traceback_text: str = ""
    phase: str = ""  # where in the case it was raised (qgather.model.phases), when the case tagged it
    type_names: tuple[str, ...] = ()  # the exception's class and its bases, innermost first
    # The same classes as "module.qualname" (e.g. "qgather.errors.Refusal"), innermost first: what
    # `instance_of` matches, so a class is told from another of the same bare name.
    type_qualnames: tuple[str, ...] = ()
    seconds: tuple[tuple[str, float], ...] = ()  # the case's steps until the error (PhaseTracker.tagging)

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankError:
        """The record of `exc` raised on `rank`: its type (and every base), message, traceback and phase."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        mro = type(exc).__mro__
        return cls(rank, type(exc).__name__, str(exc), text, getattr(exc, "qgather_phase", None) or "",
                   tuple(c.__name__ for c in mro), tuple(qualified_name(c) for c in mro),
                   tuple(getattr(exc, "qgather_seconds", None) or ()))

    @classmethod
    def from_exceptions(cls, results: Sequence[object]) -> dict[int, RankError]:
        """The record of every exception among `results` (one per rank, by rank). Exceptions raised
        alike (type, message, phase and the same frames, chained ones too: a refusal on each of 1024
        virtual ranks) share one formatted traceback, formatted once."""
        formatted: dict[tuple, RankError] = {}
        errors = {}
        for rank, exc in enumerate(results):
            if not isinstance(exc, BaseException):
                continue
            key = (_raised_at(exc), getattr(exc, "qgather_phase", None))
            record = formatted.get(key)
            if record is None:
                record = formatted[key] = cls.from_exception(rank, exc)
            errors[rank] = replace(record, rank=rank, seconds=tuple(getattr(exc, "qgather_seconds", None) or ()))
        return errors

    def instance_of(self, cls: type) -> bool:
        """Whether the exception was an instance of `cls` (by the classes' module and qualified name)."""
        return qualified_name(cls) in self.type_qualnames

    def first_line(self, limit: int | None = 160) -> str:
        """The type and the message's first line ("Type: line"), cut to `limit` characters (None: whole;
        C++ source prefixes dropped)."""
        lines = self.message.strip().splitlines()
        if not lines:
            return self.type_name
        text = _SOURCE_PREFIX.sub("", lines[0])
        if limit is not None and len(text) > limit:
            text = text[: limit - 3] + "..."
        return f"{self.type_name}: {text}"

    def __str__(self) -> str:
        return f"rank {self.rank} raised {self.first_line()}"


def same_error_on_every_rank(errors: Mapping[int, RankError], world_size: int) -> RankError | None:
    """The lowest rank's error when every rank of `world_size` raised the same exception type with the
    same first line up to numbers (each rank may name its own shard size), else None.

    The one place that decides it: a pool keeps its ranks, and a launched job its group, only then
    (no rank can be left inside a collective), and only then can a verdict be a rejection.
    """
    if world_size < 1 or set(errors) != set(range(world_size)):
        return None
    kinds = {(e.type_name, e.type_qualnames[:1], _NUMBER.sub("#", e.first_line(limit=None))) for e in errors.values()}
    return errors[0] if len(kinds) == 1 else None


class OutcomeStatus(str, enum.Enum):
    """How a case ended on its ranks, before any verdict (the `str` mix-in keeps `status == "ok"` true):

    - ``OK``: every rank returned; `CaseOutcome.results` holds each rank's value.
    - ``ERROR``: some rank raised and no rank died; `errors` holds what each rank raised, and
      `unfinished` the ranks that never answered (seen waiting for it in a collective, or out of time)
      or that left the case before a collective it would never join (`held_back`).
    - ``HANG``: the deadline passed with no rank raising or dying and some rank not returning;
      `unfinished` names those ranks and `stacks` holds their stack dumps (on a pool: every rank's).
    - ``CRASH``: a rank's process died (`exit_codes`: its exit code, or minus the signal), or a
      launched job lost a rank; `stacks` holds what every rank still alive dumped when it was stopped.
    """

    OK = "ok"
    ERROR = "error"
    HANG = "hang"
    CRASH = "crash"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CaseOutcome:
    """The verdict-neutral record of one case on every rank of a pool, built once when the case ends."""

    status: OutcomeStatus
    results: list[Any]
    errors: dict[int, RankError] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)
    exit_codes: dict[int, int] = field(default_factory=dict)
    duration_s: float = 0.0
    #: seconds spent starting the pool's ranks before this case (0: the pool was warm)
    startup_s: float = 0.0
    #: of those, seconds an NCCL pool waited for its GPUs (qgather.runtime.gpu_lease) before spawning
    lease_wait_s: float = 0.0
    #: the start's seconds phase by phase (RankPool.start_phases; empty when the pool was warm)
    startup_phases: tuple[tuple[str, float], ...] = ()
    case_id: str = ""
    unfinished: tuple[int, ...] = ()  # ranks that neither returned, raised nor died
    #: of those, the ranks that left their case before a collective the failed rank would never join,
    #: by that collective's name (qgather.runtime.agreement): the pool stays warm
    held_back: dict[int, str] = field(default_factory=dict)
    note: str = ""
    notes: dict[int, dict[str, str]] = field(default_factory=dict)  # per rank: what its case noted (whereabouts)
    # Under a launcher (ExternalPool): "intra-node" | "cross-node", and per group rank its job rank and host.
    placement: str = ""
    job_ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", OutcomeStatus(self.status))  # ValueError for anything else

    @property
    def world_size(self) -> int:
        """The number of ranks the case ran on."""
        return len(self.results)

    @property
    def ok(self) -> bool:
        """Whether every rank returned."""
        return self.status is OutcomeStatus.OK

    def headline(self) -> str:
        """What happened, in one line (the case id is not repeated: callers print it beside it)."""
        return self.summary().splitlines()[0]

    def summary(self) -> str:
        """What happened, for humans: the headline, with the note (e.g. why a pool did not start)."""
        head = _HEADLINES[self.status](self)
        return f"{head} ({self.note})" if self.note else head


def format_ranks(ranks: list[int] | set[int]) -> str:
    """Ranks in order, comma-separated ("0,2,3")."""
    return ",".join(str(r) for r in sorted(ranks))


def describe_exit(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


Frame = tuple[str, int, str]  # (file, line, function)
# This package's own frames: qgather/runtime/ in a checkout and in an install alike.
RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__)).replace("\\", "/") + "/"
_LIBRARY_PARTS = ("/torch/", "/multiprocessing/", RUNTIME_DIR, "/threading.py", "/selectors.py",
                  "/queue.py", "/concurrent/", "/asyncio/", "/subprocess.py", "/socket.py", "<frozen ")


def case_frames(stack_text: str) -> list[Frame]:
    """The frames (innermost first) of the thread running the case in a faulthandler dump: the one
    with a CASE_FRAME frame, else the first thread listed (faulthandler puts the current one first)."""
    threads = _threads(stack_text)
    for frames in threads:
        if any(func == CASE_FRAME for _, _, func in frames):
            return frames
    return threads[0] if threads else []


def is_library_frame(frame: Frame) -> bool:
    """torch, multiprocessing, threading and the like, and this runtime: not the code under test."""
    file = frame[0].replace("\\", "/")
    return any(part in file for part in _LIBRARY_PARTS)


def first_impl_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame of the implementation under test (or its case code), if any."""
    return next((frame for frame in frames if not is_library_frame(frame)), None)


def where_blocked(stack_text: str) -> str:
    """Name the call a rank is stuck in, from its faulthandler dump (all threads).

    Walking the case thread from its innermost frame: the first torch.distributed frame means it
    waits in that collective; the first frame of the code under test (an adapter spinning or
    waiting in its own code) is named instead when it comes first.
    """
    frames = case_frames(stack_text)
    if not any(func == CASE_FRAME for _, _, func in frames):
        return "not running the case"
    held = waits_at_hold(func for _, _, func in frames)
    if held is not None:  # runtime/agreement.py: outside the library's collective, waiting for every rank
        return f"waiting at qgather's hold before a collective ({held})"
    for frame in frames:  # innermost first
        file, line, func = frame
        if "torch/distributed/" in file.replace("\\", "/"):
            return f"waiting in a collective ({func})"
        if not is_library_frame(frame):
            return f"in {func} ({file.rsplit('/', 1)[-1]}:{line})"
    file, line, func = frames[0]
    return f"in {func} ({file.rsplit('/', 1)[-1]}:{line})"


def thread_frames(stack_text: str) -> dict[int, list[Frame]]:
    """Each thread's frames (innermost first) in a faulthandler dump of all threads, by thread id
    (threading.get_ident's)."""
    return {thread.ident: thread.frames for thread in _dumped_threads(stack_text) if thread.frames}


def crash_elsewhere(stack_text: str) -> tuple[str, list[Frame]] | None:
    """Where a fatal signal's dump (faulthandler's "Fatal Python error: ...") says the rank crashed, when
    that was not the case's thread: the error and the crashing thread's frames (innermost first), or no
    frames for a thread without Python ones (gloo's, OpenMP's, a library's own: faulthandler then marks
    no thread current). None for a dump that is no crash's (SIGTERM's) or a crash in the case's thread."""
    fatal = _FATAL.search(stack_text)
    if fatal is None:
        return None
    current = next((t.frames for t in _dumped_threads(stack_text) if t.current), [])
    if any(func == CASE_FRAME for _, _, func in current):
        return None
    return fatal["what"].strip(), current


def _threads(stack_text: str) -> list[list[Frame]]:
    return [thread.frames for thread in _dumped_threads(stack_text) if thread.frames]


@dataclass(frozen=True)
class _DumpedThread:
    ident: int
    current: bool  # the thread faulthandler ran in ("Current thread"): a fatal signal's, for a crash
    frames: list[Frame]  # innermost first


def _dumped_threads(stack_text: str) -> list[_DumpedThread]:
    """Every thread of a faulthandler dump, in the dump's order."""
    threads: list[_DumpedThread] = []
    for line in stack_text.splitlines():
        header = _THREAD_HEADER.match(line)
        if header:
            threads.append(_DumpedThread(int(header["id"], 16), header["kind"] == "Current thread", []))
            continue
        match = _FRAME.match(line)
        if match and threads:
            threads[-1].frames.append((match["file"], int(match["line"]), match["func"]))
    return threads


def _others(outcome: CaseOutcome) -> str:
    """Group the ranks that did not report by where they were stuck."""
    by_place: dict[str, list[int]] = {}
    for rank in outcome.unfinished:
        if rank in outcome.held_back:
            place = f"held before a collective ({outcome.held_back[rank]})"
        else:
            place = where_blocked(outcome.stacks[rank]) if rank in outcome.stacks else "did not report"
        by_place.setdefault(place, []).append(rank)
    return "; ".join(f"{ranks_word(ranks)} {_were(ranks)} {place}" for place, ranks in by_place.items())


def ranks_word(ranks: list[int]) -> str:
    """"rank 2", or "ranks 0,1" for several."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def _were(ranks: list[int]) -> str:
    return "was" if len(ranks) == 1 else "were"


def _summary_ok(outcome: CaseOutcome) -> str:
    return f"ok on {outcome.world_size} ranks in {outcome.duration_s * 1e3:.1f} ms"


def _summary_error(outcome: CaseOutcome) -> str:
    same = same_error_on_every_rank(outcome.errors, outcome.world_size)
    if same is not None:
        return f"every rank raised {same.first_line()}"
    errors = list(outcome.errors.values())
    first = errors[0]
    text = str(first)
    if len(errors) > 1:
        text += f" (also raised on {ranks_word([e.rank for e in errors[1:]])})"
    others = _others(outcome)
    return f"{text} ({others})" if others else text


def _summary_hang(outcome: CaseOutcome) -> str:
    places = _others(outcome)
    return f"HANG after {outcome.duration_s:.1f} s: {places or 'no rank reported'}" + _unequal_gathers(outcome)


def _unequal_gathers(outcome: CaseOutcome) -> str:
    """Ranks that handed the all-gather different sizes: on GPUs that collective waits on the device,
    and the host threads are found wherever they next synchronized, not in the collective."""
    sent = gather_note.unequal_sizes(outcome.notes)
    if not sent:
        return ""
    sizes = ", ".join(f"rank {rank} {size}" for rank, size in sorted(sent.items()))
    return (f"; the ranks handed the all-gather different sizes (bytes: {sizes}), so it can never complete "
            "(on GPUs it waits on the device while each host thread runs on to its next synchronization)")


def _summary_crash(outcome: CaseOutcome) -> str:
    deaths = "; ".join(f"rank {rank} {describe_exit(code)}" for rank, code in outcome.exit_codes.items())
    text = f"CRASH: {deaths or 'a rank was lost'}"
    if outcome.errors:
        by_type: dict[str, list[RankError]] = {}
        for error in outcome.errors.values():
            by_type.setdefault(error.type_name, []).append(error)
        then = "; ".join(f"{ranks_word([e.rank for e in errors])} raised {errors[0].first_line(limit=80)}"
                         for errors in by_type.values())
        text += f" (then {then})"
    return text


_HEADLINES = {OutcomeStatus.OK: _summary_ok, OutcomeStatus.ERROR: _summary_error, OutcomeStatus.HANG: _summary_hang,
              OutcomeStatus.CRASH: _summary_crash}
