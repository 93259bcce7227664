"""Every monkeypatch qgather makes of torch.distributed or of a subclass's FSDP2 hooks, each a named
context manager that restores the original in `finally` (as torch's own `patch_all_gather` does).

Patches nest: each one wraps whatever is installed when it is entered (another patch's wrapper
included) and puts exactly that back when it leaves, so they must be left in reverse order, which
`with` blocks do. A hook a class only inherits is wrapped on the class itself and removed again,
so that lookup finds the base's hook afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from qgather.model.phases import Phase, PhaseTracker

#: FSDP2 calls all_gather_single on newer torch and all_gather_into_tensor on older ones; one may
#: call the other (patches that count must count only the outermost call).
ALL_GATHER_FUNCTIONS = ("all_gather_single", "all_gather_into_tensor")

_ABSENT = object()


@contextlib.contextmanager
def _replaced(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """`owner.name` is `replacement` while active; then what `owner` itself held (or nothing)."""
    own = vars(owner).get(name, _ABSENT)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if own is _ABSENT:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, own)


@contextlib.contextmanager
def _all_gathers_wrapped(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Each of torch.distributed's ALL_GATHER_FUNCTIONS (those this torch has) is wrap(original)."""
    with contextlib.ExitStack() as stack:
        for name in ALL_GATHER_FUNCTIONS:
            if hasattr(dist, name):
                stack.enter_context(_replaced(dist, name, wrap(getattr(dist, name))))
        yield


@contextlib.contextmanager
def _hooks_wrapped(param_types: Iterable[type], name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Each class's hook `name` (its own or inherited; classes without one are left alone) is wrap(original)."""
    with contextlib.ExitStack() as stack:
        for cls in param_types:
            original = getattr(cls, name, None)
            if original is not None:
                stack.enter_context(_replaced(cls, name, wrap(original)))
        yield


# ------------------------------------------------------------------ the named patches
@contextlib.contextmanager
def hooks_moving_phase(phases: PhaseTracker, param_types: Iterable[type]) -> Iterator[None]:
    """While active, the FSDP2 hooks of `param_types` move `phases`: pre-all-gather hook, then the
    collective, then the post-all-gather hook, so that an error inside FSDP2's unshard carries
    the phase it was raised in."""

    def moving(enter: Phase, leave: Phase) -> Callable[[Callable], Callable]:
        def wrap(hook: Callable) -> Callable:
            @functools.wraps(hook)  # FSDP2 inspects the hook's signature
            def wrapper(*args, **kwargs):
                phases.current = enter
                result = hook(*args, **kwargs)
                phases.current = leave
                return result

            return wrapper

        return wrap

    param_types = tuple(param_types)
    with _hooks_wrapped(param_types, "fsdp_pre_all_gather", moving(Phase.PRE_HOOK, Phase.COLLECTIVE)), \
            _hooks_wrapped(param_types, "fsdp_post_all_gather", moving(Phase.POST_HOOK, Phase.COLLECTIVE)):
        yield


@contextlib.contextmanager
def all_gathers_counted(count: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """While active, every outermost all-gather call hands its input tensor to `count` before it runs."""
    depth = 0

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def counting(output, input, *args, **kwargs):
            nonlocal depth
            if depth == 0:
                count(input)
            depth += 1
            try:
                return original(output, input, *args, **kwargs)
            finally:
                depth -= 1

        return counting

    with _all_gathers_wrapped(wrap):
        yield


@contextlib.contextmanager
def pre_all_gather_observed(param_types: Iterable[type],
                            observe: Callable[[tuple[torch.Tensor, ...]], None]) -> Iterator[None]:
    """While active, the all-gather inputs each of `param_types`' fsdp_pre_all_gather returns are
    handed to `observe` (the hook's result is passed on untouched)."""

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)  # FSDP2 inspects the hook's signature
        def pre_all_gather(self, *args, **kwargs):
            inputs, metadata = original(self, *args, **kwargs)
            observe(tuple(inputs))
            return inputs, metadata

        return pre_all_gather

    with _hooks_wrapped(param_types, "fsdp_pre_all_gather", wrap):
        yield


FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


@contextlib.contextmanager
def float8_all_gathers_as_bytes() -> Iterator[None]:
    """While active, float8 tensors reach the all-gather functions viewed as uint8 (the same bytes;
    only the dtype the backend sees changes): gloo rejects float8 dtypes ("Invalid scalar type")."""

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype in FLOAT8_DTYPES else t

    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def gather(output, input, *args, **kwargs):
            return original(as_bytes(output), as_bytes(input), *args, **kwargs)

        return gather

    with _all_gathers_wrapped(wrap):
        yield


@contextlib.contextmanager
def guard_latency_unmeasured() -> Iterator[None]:
    """While active, Dynamo does not time the guards of a graph it compiles. torch evaluates a new
    graph's guards once after flushing the CPU caches, for a log line and a compile metric alone (the
    guards themselves are built and checked as ever): a quarter of the CPU time of compiling a small
    linear layer on the 2-core CI machine, paid by every rank for every graph. Nothing is patched where
    this torch has no such step."""
    import torch._dynamo.guards as guards  # a compiled case's rank has torch._dynamo loaded already

    if not callable(getattr(guards, "profile_guard_manager", None)):
        yield
        return
    with _replaced(guards, "profile_guard_manager", _guard_latency_not_measured):
        yield


def _guard_latency_not_measured(*args: Any) -> float:
    return 0.0
