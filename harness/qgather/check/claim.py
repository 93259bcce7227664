"""Whether an adapter's quantized weight has the buffers of the format it claims, checked on the full
weight before FSDP2 shards it: a layout that differs there (a scale of shape (128,) where the format
holds (1,)) is the adapter claiming a format its tensors do not have, not a broken all-gather, and is
reported as that before any data moves.
"""

from __future__ import annotations

import torch

from qgather.errors import HarnessFault
from qgather.formats import Format, FormatError
from qgather.impls.base import Implementation


class ClaimedFormatError(HarnessFault):
    """The adapter's tensors are not of the format it claims (`Implementation.formats`): an adapter
    fault, an ERROR on every rank, never a rejection or a gather's mismatch."""


def check_claimed_format(impl: Implementation, fmt: Format, param: torch.Tensor) -> None:
    """Raise ClaimedFormatError when the unsharded quantized `param` holds a buffer of `fmt` in another
    shape or element size than `fmt.buffer_specs` says; nothing where the format cannot
    hold the shape (the adapter should refuse it) or the weight is not quantized yet (a library that
    casts at gather time)."""
    problem = claimed_format_problem(impl, fmt, param)
    if problem:
        raise ClaimedFormatError(
            f"{impl.name} claims format {fmt.name}, but its quantized weight is not of that format: {problem}; "
            f"declare the format its tensors have (a format of your own: README, 'Your own format')")


def claimed_format_problem(impl: Implementation, fmt: Format, param: torch.Tensor) -> str | None:
    """What of `param`'s buffers (read_buffers) differs from `fmt`'s layout for its shape (None: nothing)."""
    shape = tuple(param.shape)
    try:
        fmt.check(shape)
        if not impl.is_quantized(param):
            return None
        got = impl.read_buffers(param)
    except (FormatError, RuntimeError, NotImplementedError):
        return None  # judged where it belongs: a refusal, or the gathered weight's own checks
    problems = []
    for name, (want_shape, want_dtype) in fmt.buffer_specs(shape).items():
        have = got.get(name)
        # a buffer the library makes only when it gathers (TE's columnwise copies) may be missing here
        if have is not None and (tuple(have.shape) != tuple(want_shape) or have.element_size() != want_dtype.itemsize):
            problems.append(f"{name} {_layout(have.dtype, have.shape)} where {fmt.name} has "
                            f"{_layout(want_dtype, want_shape)}")
    return "; ".join(problems) or None


def _layout(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')}{tuple(shape)}"
