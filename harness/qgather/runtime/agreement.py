"""Hold a case's collectives until every rank is there, so that a rank that failed can release the others.

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

The same all-reduce carries what each rank hands a collective whose input must be alike on every rank
(SIZED: an all-gather into one tensor, a reduce-scatter, an all-reduce, a broadcast). Ranks that hand
it different sizes (a short rank's unpadded shard) would not come out of it as a case: NCCL waits
forever or reads past the shorter buffer, gloo aborts the process. Held, every rank raises
`UnequalCollectiveSizes` instead, naming each rank's bytes, before any of it enters the collective;
the pool stays warm.

Held, besides torch.distributed's functions: torch's functional collectives (the ops DTensor and
torchao's amax reduction issue), and the library methods that all-reduce an amax from native code
(TransformerEngine's current-scaling and NVFP4 quantizers, with amax reduction), each when its group
takes every rank of the pool (runtime/held_collectives.py names them). On the GPU gate (1 x H200,
2026-11-29) ranks left in torchao's functional all-reduce aborted 43 pools in one run; in the next, 39
such cases were released at the hold instead. No case has been released at TE's quantizers yet: 16 TE
cases still left a rank inside `quantize_impl`'s native call (docs/gpu-results.md).

What it cannot hold: collectives over part of the ranks (HSDP's shard and replicate groups, TP, a
checkpoint's smaller world) and native collectives it does not know. A rank waiting in one of those
is left behind as before.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qgather.runtime.held_collectives import (
    CODES,
    FUNCTIONAL,
    FUNCTIONAL_SIZED,
    HELD,
    NATIVE,
    SIZED,
    held_frame_name,
)

# A call that issues no collective of every rank of the pool (a group of some ranks, no amax reduction).
NOT_HELD = object()

# The side all-reduce (MAX) of [failed, collective, -collective, bytes, -bytes]: the maxima and minima.
FAILED, CODE_MAX, CODE_MIN, BYTES_MAX, BYTES_MIN = range(5)


class HeldBackError(BaseException):
    """Another rank failed: this rank leaves its case before `collective` instead of waiting in it. A
    BaseException, so that no case's or library's `except Exception` takes it for the case's own error."""

    def __init__(self, collective: str) -> None:
        super().__init__(f"held before {collective}: another rank had failed")
        self.collective = collective


class UnequalCollectiveSizes(BaseException):
    """Every rank came to the same collective with inputs of different sizes: raised on every rank
    before any of them enters it. A BaseException, as HeldBackError is: no `except Exception` of a
    case or library takes it for its own."""

    def __init__(self, collective: str, sizes: Sequence[int]) -> None:
        handed = ", ".join(f"rank {rank}: {size} bytes" for rank, size in enumerate(sizes))
        super().__init__(f"the ranks handed {collective} different sizes ({handed}): qgather held every rank "
                         "before it (NCCL would wait forever or read past the shorter buffers; gloo aborts)")
        self.collective = collective
        self.sizes = tuple(sizes)


@dataclass(frozen=True)
class _Site:
    """One held collective: the attribute `name` of `owner` (torch.distributed, the functional ops'
    namespace, a library class), and what a call of it hands the collective (`called`)."""
    owner: Any
    name: str
    code: str  # its name in CODES
    called: Callable[[Sequence[Any], dict[str, Any]], tuple[Any, int]]  # (group or NOT_HELD, input bytes or -1)
    is_op: bool = False  # an op packet: its overloads (`.default`, which compiled graphs call) stay reachable


class _HeldOp:
    """An op packet's stand-in while a case runs: a call is held, any attribute (an overload) is the packet's."""

    def __init__(self, held: Callable[..., Any], packet: Any) -> None:
        self._held_call = held
        self._packet = packet

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._held_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


class Agreement:
    """One rank's side group and the wrappers that hold each full-group collective of a case."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo")
        self._flag = torch.zeros(5, dtype=torch.int64)
        self._inside = threading.local()  # a collective that calls others (all_gather_object) holds once
        self._held: dict[tuple[int, str], tuple[_Site, Any, Any]] = {}  # (id(owner), name): site, original, wrapper
        for site in (*_distributed_sites(), *_functional_sites()):
            self._hold(site)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """While the case runs: its collectives are held (and released on the way out)."""
        for site in _native_sites():  # a case may have imported the library since the last one
            self._hold(site)
        held = list(self._held.values())
        for site, _, wrapper in held:
            setattr(site.owner, site.name, wrapper)
        try:
            yield
        finally:
            for site, original, _ in held:
                setattr(site.owner, site.name, original)

    def release(self) -> None:
        """Join the all-reduce the other ranks wait in, saying that this rank will not come."""
        self._wait_for_every_rank(1)

    def _hold(self, site: _Site) -> None:
        key = (id(site.owner), site.name)
        if key in self._held:
            return
        original = getattr(site.owner, site.name)

        def held(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or getattr(self._inside, "depth", 0):
                return original(*args, **kwargs)
            group, nbytes = site.called(args, kwargs)
            if group is NOT_HELD or not self._full(group):
                return original(*args, **kwargs)
            self._inside.depth = 1
            try:
                if self._wait_for_every_rank(0, CODES.index(site.code) + 1, nbytes):
                    raise HeldBackError(site.code)
                if self._sizes_differ():
                    raise UnequalCollectiveSizes(site.code, self._every_ranks_bytes(nbytes))
                return original(*args, **kwargs)
            finally:
                self._inside.depth = 0
        # The wrapper's frame is named after what it holds (HELD_FRAME_PREFIX): a stack or whereabouts
        # of a rank waiting at the hold names the collective it waits to enter, not the side all-reduce.
        held.__code__ = held.__code__.replace(co_name=held_frame_name(site.code))
        wrapper = _HeldOp(held, original) if site.is_op else functools.wraps(original)(held)
        self._held[key] = (site, original, wrapper)

    def _full(self, group: Any) -> bool:
        """Does a collective over `group` (None: WORLD) take every rank of the pool?"""
        return group is None or dist.get_world_size(group) == self.world_size

    def _wait_for_every_rank(self, flag: int, collective: int = 0, nbytes: int = -1) -> bool:
        """The side all-reduce (MAX): True when some rank came with 1 (it failed). whereabouts finds a
        rank waiting here by this function's name (whereabouts.AGREEMENT_WAIT; tests/test_runtime_hold.py checks it)."""
        self._flag.copy_(torch.tensor([flag, collective, -collective, nbytes, -nbytes]))
        self._unheld("all_reduce")(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag[FAILED].item())

    def _sizes_differ(self) -> bool:
        """After the side all-reduce: every rank came to one SIZED collective, with different sizes."""
        same_collective = int(self._flag[CODE_MAX]) == -int(self._flag[CODE_MIN])
        sized = int(self._flag[BYTES_MAX]) >= 0 and -int(self._flag[BYTES_MIN]) >= 0
        return same_collective and sized and int(self._flag[BYTES_MAX]) != -int(self._flag[BYTES_MIN])

    def _unheld(self, name: str) -> Callable[..., Any]:
        """torch.distributed's own function, not the wrapper a case sees."""
        return self._held[(id(dist), name)][1]

    def _every_ranks_bytes(self, nbytes: int) -> list[int]:
        """What each rank handed the collective (every rank asks: every rank saw the sizes differ)."""
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._unheld("all_gather")(gathered, torch.tensor([nbytes]), group=self.group)
        return [int(t.item()) for t in gathered]


def _distributed_sites() -> list[_Site]:
    def called(name: str) -> Callable[[Sequence[Any], dict[str, Any]], tuple[Any, int]]:
        def read(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int]:
            group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
            return group, _input_bytes(name, args, kwargs)
        return read
    return [_Site(dist, name, name, called(name)) for name in HELD if hasattr(dist, name)]


def _functional_sites() -> list[_Site]:
    """torch.ops._c10d_functional's ops, replaced on the namespace: the functional collectives look them
    up there at each call (an op the running code already holds, e.g. a compiled graph's, is not held)."""
    namespace = torch.ops._c10d_functional

    def called(name: str) -> Callable[[Sequence[Any], dict[str, Any]], tuple[Any, int]]:
        def read(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int]:
            group = _group_named(kwargs.get("group_name", args[-1] if args else None))
            tensor = args[0] if args else None
            sized = name in FUNCTIONAL_SIZED and isinstance(tensor, torch.Tensor)
            return group, tensor.numel() * tensor.element_size() if sized else -1
        return read
    return [_Site(namespace, name, f"{name} (functional)", called(name), is_op=True)
            for name in FUNCTIONAL if _has_op(namespace, name)]


def _native_sites() -> list[_Site]:
    """The NATIVE methods of the libraries this rank has imported."""
    sites = []
    for module_name, class_name, methods in NATIVE:
        owner = getattr(sys.modules.get(module_name), class_name, None)
        sites += [_Site(owner, method, f"{class_name}.{method}", _amax_group)
                  for method in methods if owner is not None and hasattr(owner, method)]
    return sites


def _amax_group(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """A quantizer's amax reduction group for this call (self, src[, dst]): the destination's group
    where it has one (update_quantized), else the quantizer's own if it reduces the amax; None: WORLD."""
    quantizer = args[0] if args else None
    destination = kwargs.get("dst", args[2] if len(args) > 2 else None)
    group = getattr(destination, "amax_reduction_group", None)
    if group is not None:
        return group, -1
    if getattr(quantizer, "with_amax_reduction", False):
        return getattr(quantizer, "amax_reduction_group", None), -1
    return NOT_HELD, -1


def _group_named(name: Any) -> Any:
    """The process group a functional collective names; NOT_HELD where it cannot be found."""
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception:  # noqa: BLE001 - an unknown name: the op itself says what is wrong
        return NOT_HELD


def _has_op(namespace: Any, name: str) -> bool:
    try:
        getattr(namespace, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _input_bytes(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The bytes of a SIZED collective's input (-1 for any other collective, or an input it cannot read)."""
    if name not in SIZED:
        return -1
    position, keyword = SIZED[name]
    tensor = kwargs.get(keyword, args[position] if len(args) > position else None)
    if not isinstance(tensor, torch.Tensor):
        return -1
    return tensor.numel() * tensor.element_size()
