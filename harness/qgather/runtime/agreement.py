"""Hold a case's collectives until every rank of their group is there: a rank that failed can release the others.

Without it, a rank that raises before a collective (a pre-all-gather hook refusing its shard, an
assertion in FSDP2's copy-in) leaves the other ranks inside that collective, where nothing but
killing them ends the wait: the pool is aborted and the next case starts a new one, which on a GPU
host costs seconds (CUDA contexts, NCCL communicators) where the case itself costs milliseconds.

With it, every collective a case issues over all of the pool's ranks (torch.distributed's functions,
called while the case runs) is preceded by one small all-reduce on a gloo group of its own. A rank that
failed is not there; the others wait in that all-reduce, outside any library collective. The runner
sees every rank that has not answered waiting there (whereabouts, as for any collective), and tells the
ranks that did answer to join it once (`Release`): their 1 meets the waiting ranks' 0, the waiting ranks
leave their case with `HeldBack`, nobody is inside a library collective, and the pool stays warm.

A collective over part of the ranks (HSDP's shard and replicate groups, TP's groups of a 2-D mesh, a
functional collective over one mesh dimension) is held by its group's members only: ranks outside it
never call it (a case may well issue a collective on some ranks alone), and no group is made for it.
Each member sets its key in the pool's store (`<case>/<group's ranks>/<sequence>/<rank>`: the members
issue their group's collectives in one order, so each keeps the group's count of them in the case), and
waits until every member's key is there. A rank says where it waits (whereabouts.waiting_at: the group's
ranks and that count); once every member of that group has answered or waits there too, the runner asks
the members that answered to set their keys with a 1, which sends the waiting ones out with `HeldBack`.
Waits that depend on each other end in turn: a member released from a pair's wait has answered, and can
then release a wait of every rank that it kept from completing. Each rank removes its keys of a case when
the next case begins (every rank has left that case's waits by then), so the store's keys do not pile
up; the store's file grows by each set and removal (~100 bytes a member and collective), as it does by
the keys of every process group a case makes.

The same agreement carries what each rank hands a collective whose input must be alike on every rank
(SIZED: an all-gather into one tensor, a reduce-scatter, an all-reduce, a broadcast). Ranks that hand
it different sizes (a short rank's unpadded shard) would not come out of it as a case: NCCL waits
forever or reads past the shorter buffer, gloo aborts the process. Held, every member raises
`UnequalCollectiveSizes` instead, naming each member's bytes, before any of it enters the collective;
the pool stays warm.

The library methods that all-reduce an amax from native code (NATIVE) hand the agreement the bytes of
the input they quantize. TE's return before that all-reduce on an empty input (EMPTY_INPUT_SKIPS): where
some members come with a zero-row shard and others with rows, every member raises `UnjoinedCollective`
before the call, naming the empty ones; the ranks with rows would otherwise wait inside it for ranks that
never come, and only killing them ends that (a HANG, or an ERROR whose ranks are left behind).

Held, besides torch.distributed's functions: torch's functional collectives (the ops DTensor and
torchao's amax reduction issue), and the library methods that all-reduce an amax from native code
(TransformerEngine's current-scaling and NVFP4 quantizers, with amax reduction), over every rank or
some (runtime/held_collectives.py names them). On the GPU gate (1 x H200, 2026-11-29) ranks left in
torchao's functional all-reduce aborted 43 pools in one run; in the next, 39 such cases were released at
the hold instead, while 25 cases still left ranks in collectives over part of the ranks (held since).
TE cases still left a rank inside `quantize_impl`'s native call: 40 in one run, each a zero-row shard
beside shards with rows (stopped at the hold since, as above; docs/gpu-results.md).

What it cannot hold: native collectives it does not know, collectives a compiled graph issues (its ops
are bound when it compiles), and a collective over a group torch.distributed does not list. A rank
waiting in one of those, or for a rank that died, is left behind as before. Collectives over groups of
the same ranks count as one group's: members that issue them in different orders would compare the
sizes of different collectives.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qgather.runtime import whereabouts
from qgather.runtime.held_collectives import CODES, EMPTY_INPUT_SKIPS, held_frame_name
from qgather.runtime.hold_sites import NOT_HELD, HeldOp, Site, every_site, native_sites
from qgather.runtime.outcome import format_ranks, ranks_word
from qgather.runtime.protocol import HeldWait

# The store's keys of the held collectives over part of the ranks: <case>/<group's ranks>/<sequence>/<rank>.
STORE_PREFIX = "qgather-hold/"
POLL_FIRST_S = 50e-6  # a member's first pause between looks at the others' keys
POLL_MAX_S = 1e-3  # its longest

# The side all-reduce (MAX) of [failed, collective, -collective, bytes, -bytes]: the maxima and minima.
FAILED, CODE_MAX, CODE_MIN, BYTES_MAX, BYTES_MIN = range(5)


class HeldBackError(BaseException):
    """Another rank failed: this rank leaves its case before `collective` instead of waiting in it. A
    BaseException, so that no case's or library's `except Exception` takes it for the case's own error."""

    def __init__(self, collective: str) -> None:
        super().__init__(f"held before {collective}: another rank had failed")
        self.collective = collective


class _StoppedBeforeCollective(BaseException):
    """Every member of a group came to one collective with inputs that keep them out of it: raised on each
    of them before any of them enters it. A BaseException, as HeldBackError is: no `except Exception` of a
    case or library takes it for its own."""

    def __init__(self, collective: str, sizes: Mapping[int, int], message: str) -> None:
        super().__init__(message)
        self.collective = collective
        self.sizes = dict(sizes)


class UnequalCollectiveSizes(_StoppedBeforeCollective):
    """The members handed a SIZED collective inputs of different sizes."""

    def __init__(self, collective: str, sizes: Mapping[int, int]) -> None:
        handed = ", ".join(f"rank {rank}: {size} bytes" for rank, size in sorted(sizes.items()))
        super().__init__(collective, sizes, f"the ranks handed {collective} different sizes ({handed}): qgather held "
                         "every rank before it (NCCL would wait forever or read past the shorter buffers; gloo aborts)")


class UnjoinedCollective(_StoppedBeforeCollective):
    """Some members came with an empty input to a library method that all-reduces its amax from native
    code and returns before that all-reduce on an empty input (EMPTY_INPUT_SKIPS): the others would wait
    in it forever."""

    def __init__(self, collective: str, sizes: Mapping[int, int]) -> None:
        empty = [rank for rank, size in sorted(sizes.items()) if size == 0]
        others = [rank for rank, size in sorted(sizes.items()) if size > 0]
        super().__init__(collective, sizes, f"{ranks_word(empty)} handed {collective} an empty input, on which it "
                         f"returns before its amax all-reduce, which {ranks_word(others)} would enter and wait in "
                         "forever: qgather held every rank before it")


class HeldWaitTimeout(RuntimeError):
    """Members of a group did not come to a held collective within the process group's timeout."""


@dataclass(frozen=True)
class _Arrival:
    """What one member said at a held collective over part of the ranks (its key in the store)."""
    failed: bool
    code: int
    nbytes: int

    def encode(self) -> bytes:
        return f"{int(self.failed)},{self.code},{self.nbytes}".encode()

    @classmethod
    def decode(cls, value: bytes) -> _Arrival:
        failed, code, nbytes = (int(part) for part in value.decode().split(","))
        return cls(bool(failed), code, nbytes)


class Agreement:
    """One rank's side group, its keys in the pool's store, and the wrappers that hold each collective
    of a case over a group this rank is a member of."""

    def __init__(self, world_size: int, store: dist.Store, timeout_s: float) -> None:
        self.world_size = world_size
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo")
        self._store = dist.PrefixStore(STORE_PREFIX, store)
        self._timeout_s = timeout_s
        self._flag = torch.zeros(5, dtype=torch.int64)
        self._inside = threading.local()  # a collective that calls others (all_gather_object) holds once
        self._held: dict[tuple[int, str], tuple[Site, Any, Any]] = {}  # (id(owner), name): site, original, wrapper
        self._case = 0  # the pool's count of cases: a case's keys never meet an earlier case's
        self._sequences: dict[tuple[int, ...], int] = {}  # a group's ranks -> its held collectives in this case
        self._keys: list[str] = []  # this rank's keys in the store, removed at the next case
        for site in every_site():
            self._hold(site)

    def next_case(self) -> None:
        """A new case begins (on every rank, before anything of it can fail): count it, and remove this
        rank's keys of the last one, which every rank has read (each answered that case, having left
        every wait of it, before the runner sent this one)."""
        self._case += 1
        self._sequences.clear()
        for key in self._keys:
            self._store.delete_key(key)
        self._keys.clear()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """While the case runs: its collectives are held (and released on the way out)."""
        for site in native_sites():  # a case may have imported the library since the last one
            self._hold(site)
        held = list(self._held.values())
        for site, _, wrapper in held:
            setattr(site.owner, site.name, wrapper)
        try:
            yield
        finally:
            for site, original, _ in held:
                setattr(site.owner, site.name, original)

    def release(self, wait: HeldWait) -> None:
        """Join the wait the other ranks of its group wait at, saying that this rank will not come: the
        side all-reduce (every rank), or this rank's key (a group of some ranks; never over one it set)."""
        if len(wait.ranks) == self.world_size:
            self._wait_for_every_rank(1)
            return
        self._keys.append(key := self._key(wait, self.rank))
        self._store.compare_set(key, "", _Arrival(True, 0, -1).encode())

    def _hold(self, site: Site) -> None:
        key = (id(site.owner), site.name)
        if key in self._held:
            return
        original = getattr(site.owner, site.name)

        def held(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or getattr(self._inside, "depth", 0):
                return original(*args, **kwargs)
            group, nbytes = site.called(args, kwargs)
            members = self._members(group)
            if members is None:
                return original(*args, **kwargs)
            self._inside.depth = 1
            try:
                self._agree(site.code, members, nbytes)
                return original(*args, **kwargs)
            finally:
                self._inside.depth = 0
        # The wrapper's frame is named after what it holds (HELD_FRAME_PREFIX): a stack or whereabouts
        # of a rank waiting at the hold names the collective it waits to enter, not the side all-reduce.
        held.__code__ = held.__code__.replace(co_name=held_frame_name(site.code))
        wrapper = HeldOp(held, original) if site.is_op else functools.wraps(original)(held)
        self._held[key] = (site, original, wrapper)

    def _members(self, group: Any) -> tuple[int, ...] | None:
        """The pool's ranks of a collective over `group` (None: WORLD), sorted; None where it is not held
        (NOT_HELD; a group this rank is not in: torch.distributed returns at once there; a group of this
        rank alone: no other rank to wait for)."""
        if group is NOT_HELD:
            return None
        if group is None:
            return tuple(range(self.world_size))
        try:
            members = tuple(sorted(dist.get_process_group_ranks(group)))
        except Exception:  # noqa: BLE001 - a group torch.distributed does not know: the collective says so
            return None
        return members if self.rank in members and len(members) > 1 else None

    def _agree(self, collective: str, members: tuple[int, ...], nbytes: int) -> None:
        """Wait until every member of the group came to this collective: HeldBackError where one of them
        failed, UnequalCollectiveSizes where they hand a SIZED collective different sizes."""
        code = CODES.index(collective) + 1
        sequence = self._sequences.get(members, 0)
        self._sequences[members] = sequence + 1
        wait = HeldWait(members, sequence)
        whereabouts.waiting_at(wait)
        try:
            if len(members) == self.world_size:
                failed = self._wait_for_every_rank(0, code, nbytes)
                sizes = dict(enumerate(self._every_ranks_bytes(nbytes))) \
                    if not failed and self._sizes_matter(collective) else {}
            else:
                arrivals = self._wait_for_members(wait, _Arrival(False, code, nbytes))
                failed = any(arrival.failed for arrival in arrivals.values())
                sizes = _sizes_that_matter(collective, arrivals)
        finally:
            whereabouts.waiting_at(None)
        if failed:
            raise HeldBackError(collective)
        if sizes and collective in EMPTY_INPUT_SKIPS:
            raise UnjoinedCollective(collective, sizes)
        if sizes:
            raise UnequalCollectiveSizes(collective, sizes)

    def _wait_for_every_rank(self, flag: int, collective: int = 0, nbytes: int = -1) -> bool:
        """The side all-reduce (MAX): True when some rank came with 1 (it failed). whereabouts finds a
        rank waiting here by this function's name (held_collectives.HOLD_WAITS; tests/test_runtime_hold.py
        checks it)."""
        self._flag.copy_(torch.tensor([flag, collective, -collective, nbytes, -nbytes]))
        self._unheld("all_reduce")(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag[FAILED].item())

    def _wait_for_members(self, wait: HeldWait, mine: _Arrival) -> dict[int, _Arrival]:
        """Set this rank's key for `wait`, then wait until every member's is there (a member that failed
        sets it when released): what each member said. Only the members take part: a rank outside the
        group never calls its collective. whereabouts finds a rank waiting here by this function's name.

        Polled (a check costs ~10 us), with pauses that grow to POLL_MAX_S: the store's own wait sleeps
        10 ms between its looks, which every collective of a group would pay."""
        keys = [self._key(wait, member) for member in wait.ranks]
        self._keys.append(keys[wait.ranks.index(self.rank)])
        self._store.set(self._keys[-1], mine.encode())
        deadline = time.monotonic() + self._timeout_s
        pause = POLL_FIRST_S
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                raise HeldWaitTimeout(f"held collective over ranks {format_ranks(list(wait.ranks))}: not every member "
                                      f"came within {self._timeout_s:g} s")
            time.sleep(pause)  # the GIL is free meanwhile: whereabouts' thread answers
            pause = min(2 * pause, POLL_MAX_S)
        return {member: _Arrival.decode(value) for member, value in zip(wait.ranks, self._store.multi_get(keys))}

    def _key(self, wait: HeldWait, rank: int) -> str:
        return f"{self._case}/{format_ranks(list(wait.ranks))}/{wait.sequence}/{rank}"

    def _sizes_matter(self, collective: str) -> bool:
        """After the side all-reduce: every rank came to `collective` with sizes that stop it (_stops)."""
        same_collective = int(self._flag[CODE_MAX]) == -int(self._flag[CODE_MIN])
        return same_collective and _stops(collective, int(self._flag[BYTES_MAX]), -int(self._flag[BYTES_MIN]))

    def _unheld(self, name: str) -> Callable[..., Any]:
        """torch.distributed's own function, not the wrapper a case sees."""
        return self._held[(id(dist), name)][1]

    def _every_ranks_bytes(self, nbytes: int) -> list[int]:
        """What each rank handed the collective (every rank asks: every rank saw sizes that stop it)."""
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._unheld("all_gather")(gathered, torch.tensor([nbytes]), group=self.group)
        return [int(t.item()) for t in gathered]


def _sizes_that_matter(collective: str, arrivals: Mapping[int, _Arrival]) -> dict[int, int]:
    """Each member's bytes where every member came to `collective` with sizes that stop it (_stops), else {}."""
    said = list(arrivals.values())
    if len({arrival.code for arrival in said}) != 1:
        return {}
    sizes = [arrival.nbytes for arrival in said]
    return {member: arrival.nbytes for member, arrival in arrivals.items()} \
        if _stops(collective, max(sizes), min(sizes)) else {}


def _stops(collective: str, largest: int, smallest: int) -> bool:
    """Whether inputs from `smallest` to `largest` bytes (-1: not read) keep the ranks out of `collective`:
    an empty input beside others where it skips its reduction on one (EMPTY_INPUT_SKIPS: uneven inputs are
    its normal case), else unequal sizes (a SIZED collective: only those have their bytes read)."""
    if smallest < 0:
        return False
    if collective in EMPTY_INPUT_SKIPS:
        return smallest == 0 < largest
    return largest != smallest
