"""Comparisons of large tensors on a GPU as one compiled kernel each (torch.compile), for
qgather.instruments.compare: a strided pair (a golden's transposed view) read in tiles, and a
golden row block dequantized in registers and compared with the library's values, so that the
block's values never exist in memory. Each returns a count of elements whose bits differ, the same
count the eager comparison gives (tests/gpu/test_fused_compare.py), or None where it does not apply:
below FUSED_MIN_ELEMENTS, off a GPU, or in a process where the compiler cannot run.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import torch

#: Pairs of at least this many elements on a GPU are compared by a compiled kernel: read element by
#: element through a transposed view, the eager comparison ran at about a tenth of the HBM bandwidth
#: (3.5 ms for 235 M bytes on an H200), and a dequantized golden block is a float32 block more.
FUSED_MIN_ELEMENTS = 1 << 22
TILE = 32  # a strided pair is reduced in TILE x TILE tiles first

# Why the compiler cannot run in this process, once it could not: a property of the process (its
# torch build, its compiler), not of a case, so it is kept where the kernels are.
_BROKEN: list[str] = []


def strided_pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `count_differing` takes this pair: one on a GPU, large, not both contiguous."""
    return (a.device.type == "cuda" and b.device == a.device and a.numel() >= FUSED_MIN_ELEMENTS
            and not (a.is_contiguous() and b.is_contiguous()) and not _BROKEN)


def count_differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Elements of a and b (one shape, one integer dtype) whose bits differ, a 0-dim tensor on the
    GPU; None where the compiler cannot run."""
    return _run(_compiled_count, a, b)


def count_differing_values(got: torch.Tensor, fn: Callable[..., torch.Tensor],
                           tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Elements of `got` whose bits differ from fn(*tensors) (float32; `got` compared as float32),
    the values made only inside the kernel; None off a GPU, below FUSED_MIN_ELEMENTS, with `tensors`
    on another device, or where the compiler cannot run."""
    if got.device.type != "cuda" or got.numel() < FUSED_MIN_ELEMENTS or _BROKEN \
            or any(t.device != got.device for t in tensors):
        return None
    return _run(functools.partial(_compiled_value_count, fn), got, *tensors)


def _run(compiled: Callable[[], Callable[..., torch.Tensor]], *tensors: torch.Tensor) -> torch.Tensor | None:
    try:
        return compiled()(*tensors)
    except Exception as exc:  # noqa: BLE001 - no compiler here: the caller compares eagerly, the same count
        _BROKEN.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
        if len(_BROKEN) == 1:
            warnings.warn(f"qgather: the compiled comparison cannot run here ({_BROKEN[0]}); large tensors "
                          "are compared eagerly", RuntimeWarning, stacklevel=3)
        return None


@functools.cache
def _compiled_count() -> Callable[..., torch.Tensor]:
    return torch.compile(_count_mask, fullgraph=True, dynamic=False)


def _count_mask(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(a != b).sum(), in TILE x TILE tiles where both dims allow: a tile's elements of a strided
    operand lie in TILE rows of its storage, which a compiled reduction then reads while cached."""
    if a.dim() == 2 and a.shape[0] % TILE == 0 and a.shape[1] % TILE == 0:
        tiles = (a.shape[0] // TILE, TILE, a.shape[1] // TILE, TILE)
        return (a.reshape(tiles) != b.reshape(tiles)).sum(dim=(1, 3)).sum()
    return (a != b).sum()


@functools.cache
def _compiled_value_count(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def count(got: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        want = fn(*tensors)
        got = got.to(want.dtype)  # float32: compare_values compares other dtypes as float32 values
        return (got.view(torch.int32) != want.view(torch.int32)).sum()

    return torch.compile(count, fullgraph=True, dynamic=False)
