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

What it cannot hold: collectives over part of the ranks (HSDP's shard and replicate groups, TP, a
checkpoint's smaller world), functional collectives and ones issued from native code (TE's amax
reduction inside its quantizer). A rank waiting in one of those is left behind as before.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed's functions that are collectives over a group (the group argument's name).
# (all_gather_single and reduce_scatter_single: what FSDP2 calls on newer torch; absent names are skipped)
HELD = ("all_gather_into_tensor", "all_gather_single", "all_gather", "all_reduce", "reduce_scatter_tensor",
        "reduce_scatter_single", "reduce_scatter", "broadcast", "barrier", "all_to_all_single", "all_to_all",
        "reduce", "gather", "scatter", "all_gather_object", "broadcast_object_list", "gather_object",
        "scatter_object_list", "all_gather_coalesced", "all_reduce_coalesced", "_all_gather_base",
        "_reduce_scatter_base")

# Collectives whose input must have as many bytes on every rank: the input's (position, keyword).
SIZED = {"all_gather_into_tensor": (1, "input_tensor"), "_all_gather_base": (1, "input_tensor"),
         "all_gather_single": (1, "input_tensor"), "reduce_scatter_tensor": (1, "input"),
         "_reduce_scatter_base": (1, "input"), "reduce_scatter_single": (1, "input"),
         "all_reduce": (0, "tensor"), "broadcast": (0, "tensor")}
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


class Agreement:
    """One rank's side group and the wrappers that hold each full-group collective of a case."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo")
        self._flag = torch.zeros(5, dtype=torch.int64)
        self._inside = threading.local()  # a collective that calls others (all_gather_object) holds once
        self._originals = {name: getattr(dist, name) for name in HELD if hasattr(dist, name)}
        self._wrappers = {name: self._held(name, original) for name, original in self._originals.items()}

    @contextmanager
    def holding(self) -> Iterator[None]:
        """While the case runs: torch.distributed's collectives are held (and released on the way out)."""
        for name, wrapper in self._wrappers.items():
            setattr(dist, name, wrapper)
        try:
            yield
        finally:
            for name, original in self._originals.items():
                setattr(dist, name, original)

    def release(self) -> None:
        """Join the all-reduce the other ranks wait in, saying that this rank will not come."""
        self._wait_for_every_rank(1)

    def _held(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def held(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0) or torch.compiler.is_compiling() or not self._full(args, kwargs):
                return original(*args, **kwargs)
            self._inside.depth = 1
            try:
                nbytes = _input_bytes(name, args, kwargs)
                if self._wait_for_every_rank(0, HELD.index(name) + 1, nbytes):
                    raise HeldBackError(name)
                if self._sizes_differ():
                    raise UnequalCollectiveSizes(name, self._every_ranks_bytes(nbytes))
                return original(*args, **kwargs)
            finally:
                self._inside.depth = 0
        return held

    def _full(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Does the call take every rank of the pool (its group: WORLD, or a group of the same size)?"""
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        return group is None or dist.get_world_size(group) == self.world_size

    def _wait_for_every_rank(self, flag: int, collective: int = 0, nbytes: int = -1) -> bool:
        """The side all-reduce (MAX): True when some rank came with 1 (it failed). whereabouts finds a
        rank waiting here by this function's name (whereabouts.AGREEMENT_WAIT; tests/test_runtime_hold.py checks it)."""
        self._flag.copy_(torch.tensor([flag, collective, -collective, nbytes, -nbytes]))
        self._originals["all_reduce"](self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag[FAILED].item())

    def _sizes_differ(self) -> bool:
        """After the side all-reduce: every rank came to one SIZED collective, with different sizes."""
        same_collective = int(self._flag[CODE_MAX]) == -int(self._flag[CODE_MIN])
        sized = int(self._flag[BYTES_MAX]) >= 0 and -int(self._flag[BYTES_MIN]) >= 0
        return same_collective and sized and int(self._flag[BYTES_MAX]) != -int(self._flag[BYTES_MIN])

    def _every_ranks_bytes(self, nbytes: int) -> list[int]:
        """What each rank handed the collective (every rank asks: every rank saw the sizes differ)."""
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._originals["all_gather"](gathered, torch.tensor([nbytes]), group=self.group)
        return [int(t.item()) for t in gathered]


def _input_bytes(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The bytes of a SIZED collective's input (-1 for any other collective, or an input it cannot read)."""
    if name not in SIZED:
        return -1
    position, keyword = SIZED[name]
    tensor = kwargs.get(keyword, args[position] if len(args) > position else None)
    if not isinstance(tensor, torch.Tensor):
        return -1
    return tensor.numel() * tensor.element_size()
