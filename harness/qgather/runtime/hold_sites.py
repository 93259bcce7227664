"""Where each held collective lives and what a call of it hands the collective (runtime/agreement.py
holds them): torch.distributed's functions, torch's functional ops, the NATIVE library methods
(runtime/held_collectives.py names them all). Each is a `Site`: the attribute to replace while a case
runs, and how to read a call's group and input bytes from its arguments."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qgather.runtime.held_collectives import FUNCTIONAL, FUNCTIONAL_SIZED, HELD, NATIVE, SIZED

# A call that issues no collective (a quantizer that does not reduce its amax; a group torch cannot resolve).
NOT_HELD = object()


@dataclass(frozen=True)
class Site:
    """One held collective: the attribute `name` of `owner` (torch.distributed, the functional ops'
    namespace, a library class), and what a call of it hands the collective (`called`)."""
    owner: Any
    name: str
    code: str  # its name in CODES
    called: Callable[[Sequence[Any], dict[str, Any]], tuple[Any, int]]  # (group or NOT_HELD, input bytes or -1)
    is_op: bool = False  # an op packet: its overloads (`.default`, which compiled graphs call) stay reachable


class HeldOp:
    """An op packet's stand-in while a case runs: a call is held, any attribute (an overload) is the packet's."""

    def __init__(self, held: Callable[..., Any], packet: Any) -> None:
        self._held_call = held
        self._packet = packet

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._held_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


def every_site() -> list[Site]:
    """torch.distributed's and torch's functional collectives: there from a rank's start."""
    return [*_distributed_sites(), *_functional_sites()]


def _distributed_sites() -> list[Site]:
    def called(name: str) -> Callable[[Sequence[Any], dict[str, Any]], tuple[Any, int]]:
        def read(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int]:
            group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
            return group, _input_bytes(name, args, kwargs)
        return read
    return [Site(dist, name, name, called(name)) for name in HELD if hasattr(dist, name)]


def _functional_sites() -> list[Site]:
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
    return [Site(namespace, name, f"{name} (functional)", called(name), is_op=True)
            for name in FUNCTIONAL if _has_op(namespace, name)]


def native_sites() -> list[Site]:
    """The NATIVE methods of the libraries this rank has imported."""
    sites = []
    for module_name, class_name, methods in NATIVE:
        owner = getattr(sys.modules.get(module_name), class_name, None)
        sites += [Site(owner, method, f"{class_name}.{method}", _amax_group)
                  for method in methods if owner is not None and hasattr(owner, method)]
    return sites


def _amax_group(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """A quantizer's amax reduction group for this call (self, src[, dst]): the destination's group
    where it has one (update_quantized), else the quantizer's own if it reduces the amax; None: WORLD.
    With it, the bytes of the input it quantizes (held_collectives.EMPTY_INPUT_SKIPS: none, no reduction)."""
    quantizer = args[0] if args else None
    source = kwargs.get("src", kwargs.get("tensor", args[1] if len(args) > 1 else None))
    nbytes = source.numel() * source.element_size() if isinstance(source, torch.Tensor) else -1
    destination = kwargs.get("dst", args[2] if len(args) > 2 else None)
    group = getattr(destination, "amax_reduction_group", None)
    if group is not None:
        return group, nbytes
    if getattr(quantizer, "with_amax_reduction", False):
        return getattr(quantizer, "amax_reduction_group", None), nbytes
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
