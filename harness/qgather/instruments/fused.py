"""Comparisons of large tensors on a GPU as one kernel each, for qgather.instruments.compare: two
buffers read flat (no boolean temporary), a strided pair (a golden's transposed view) read in
tiles, both by Triton kernels of their own where Triton imports (else by torch.compile), and a golden
row block dequantized in registers and compared with the library's values, so that the block's
values never exist in memory (the format's own Triton kernel, qgather.instruments.fused_values, else
a torch.compile'd one). Each returns a count of elements whose
bits differ, the same count the eager comparison gives (tests/gpu/test_fused_compare.py), or None
where it does not apply: below FUSED_MIN_ELEMENTS, off a GPU, or in a process where the kernel
cannot run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from qgather.instruments import fused_values, kernels

#: Pairs of at least this many elements on a GPU are compared by one kernel: read element by element
#: through a transposed view, the eager comparison ran at about a tenth of the HBM bandwidth (3.5 ms
#: for 235 M bytes on an H200), and a dequantized golden block is a float32 block more.
FUSED_MIN_ELEMENTS = 1 << 22
TILE = 32  # a strided pair is reduced in TILE x TILE tiles first (where Triton is missing)

# Why the compiler cannot run in this process, once it could not: a property of the process (its
# torch build, its compiler), not of a case, so it is kept where the kernels are (Triton's: kernels.py).
_BROKEN: list[str] = []


def large_pair(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `count_differing` takes this pair: both on one GPU, large."""
    return a.device.type == "cuda" and b.device == a.device and a.numel() >= FUSED_MIN_ELEMENTS


def count_differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Elements of a and b (one shape, one integer dtype) whose bits differ, a 0-dim tensor on the
    GPU, by one Triton kernel where Triton imports (`count_by_triton`), else one compiled kernel;
    None where neither can run."""
    count = count_by_triton(a, b)
    if count is not None or _BROKEN:
        return count
    return _run(_compiled_count, a, b)


def count_by_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Elements of two integer tensors of one shape and dtype whose bits differ, by one Triton
    kernel: two contiguous ones read flat, two 2-D ones of any strides (a library's columnwise copy
    against the golden's transposed view of its rowwise data) in square tiles (`tile_for`), each
    tile of either operand loaded along its own contiguous dimension and moved through shared memory
    by Triton, so that both are read at the memory's pace (torch.compile's tiled reduction read the
    transposed pair at a quarter of it: 1.08 ms for 235 M bytes on an H200, this kernel 0.17 ms).
    A launch costs the host a few tens of microseconds, a compiled function's call a few hundred.
    None where it does not apply (no Triton, a float dtype, offsets beyond 32 bits, another layout)
    or cannot run."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype.is_floating_point or a.dtype.is_complex \
            or a.dtype == torch.bool or max(_span(a), _span(b)) >= 1 << 31:
        return None
    triton = _triton_kernels()
    if triton is None:
        return None
    if a.is_contiguous() and b.is_contiguous():
        return _count_flat(triton, a.reshape(-1), b.reshape(-1))
    if a.dim() == 2:
        return _count_tiled(triton, a, b)
    return None


def tile_for(element_size: int) -> int:
    """The side of the square tiles a strided pair of this element size is compared in: 16 KiB of
    each operand per tile (128 x 128 bytes was the fastest of 32, 64 and 128 on an H200)."""
    return {1: 128, 2: 64, 4: 64}.get(element_size, 32)


FLAT_BLOCK_BYTES = 16384  # of each operand, per program of the flat kernel


def _count_flat(triton, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    block = FLAT_BLOCK_BYTES // a.element_size()
    return kernels.counted(triton.flat, (max(1, -(-a.numel() // block)),), a.device, a, b, a.numel(), BLOCK=block)


def _count_tiled(triton, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    tile = tile_for(a.element_size())
    grid = (-(-a.shape[0] // tile), -(-a.shape[1] // tile))
    return kernels.counted(triton.tiled, grid, a.device, a, b, a.shape[0], a.shape[1], a.stride(0), a.stride(1),
                           b.stride(0), b.stride(1), TILE=tile)


def _span(t: torch.Tensor) -> int:
    """The largest element offset `t` reaches in its storage."""
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size)


def _buffer_kernels(triton, tl) -> SimpleNamespace:
    """The Triton kernels of `count_by_triton`: two buffers read flat, a strided pair in tiles."""

    @triton.jit
    def flat(out_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        a = tl.load(a_ptr + i, mask=inside, other=0)
        b = tl.load(b_ptr + i, mask=inside, other=0)
        tl.atomic_add(out_ptr, tl.sum((a != b).to(tl.int32), axis=0).to(tl.int64), sem="relaxed")

    @triton.jit
    def tiled(out_ptr, a_ptr, b_ptr, rows, cols, a_row, a_col, b_row, b_col, TILE: tl.constexpr):
        r = tl.program_id(0) * TILE + tl.arange(0, TILE)
        c = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        a = tl.load(a_ptr + r[:, None] * a_row + c[None, :] * a_col, mask=inside, other=0)
        b = tl.load(b_ptr + r[:, None] * b_row + c[None, :] * b_col, mask=inside, other=0)
        differing = tl.sum(tl.sum((a != b).to(tl.int32), axis=1), axis=0).to(tl.int64)
        tl.atomic_add(out_ptr, differing, sem="relaxed")

    return SimpleNamespace(flat=flat, tiled=tiled)


_triton_kernels = kernels.built(_buffer_kernels)


def count_differing_values(got: torch.Tensor, fn: Callable[..., torch.Tensor],
                           tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Elements of `got` whose bits differ from fn(*tensors) (float32; `got` compared as float32),
    the values made only inside the kernel: the format's own Triton kernel where it has one, else a
    compiled one; None off a GPU, below FUSED_MIN_ELEMENTS, with `tensors` on another device, or
    where neither can run."""
    if got.device.type != "cuda" or got.numel() < FUSED_MIN_ELEMENTS or any(t.device != got.device for t in tensors):
        return None
    count = fused_values.count(got, fn, tensors)
    if count is not None or _BROKEN:
        return count
    return _run(functools.partial(_compiled_value_count, fn), got, *tensors)


#: what torch.compile raises (fullgraph=True) once a function was compiled for as many shapes and
#: dtypes as torch._dynamo allows (recompile_limit; FailOnCacheLimitHit before torch 2.6): this
#: call compares eagerly, and the compiler stays in use for the shapes it already holds
_RECOMPILE_LIMIT = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")


def _run(compiled: Callable[[], Callable[..., torch.Tensor]], *tensors: torch.Tensor) -> torch.Tensor | None:
    try:
        return compiled()(*tensors)
    except Exception as exc:  # noqa: BLE001 - no compiler here: the caller compares eagerly, the same count
        if type(exc).__name__ not in _RECOMPILE_LIMIT:
            kernels.note_broken(exc, _BROKEN, "the compiled comparison")
        return None


@functools.cache
def _compiled_count() -> Callable[..., torch.Tensor]:
    # sizes left to the compiler (static first, then dynamic): where Triton is missing, every large
    # buffer's shape comes here, more than torch._dynamo's recompile limit allows static
    return torch.compile(_count_mask, fullgraph=True, dynamic=None)


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
