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


class HeldBackError(BaseException):
    """Another rank failed: this rank leaves its case before `collective` instead of waiting in it. A
    BaseException, so that no case's or library's `except Exception` takes it for the case's own error."""

    def __init__(self, collective: str) -> None:
        super().__init__(f"held before {collective}: another rank had failed")
        self.collective = collective


class Agreement:
    """One rank's side group and the wrappers that hold each full-group collective of a case."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group = dist.new_group(backend="gloo")
        self._flag = torch.zeros(1, dtype=torch.int32)
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
                if self._wait_for_every_rank(0):
                    raise HeldBackError(name)
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

    def _wait_for_every_rank(self, flag: int) -> bool:
        """The side all-reduce (MAX): True when some rank came with 1 (it failed). whereabouts finds a
        rank waiting here by this function's name (whereabouts.AGREEMENT_WAIT; tests/test_runtime_hold.py checks it)."""
        self._flag.fill_(flag)
        self._originals["all_reduce"](self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag.item())
