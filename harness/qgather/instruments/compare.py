"""Comparisons of a gathered weight against the single-device golden, and where they differ.

Buffers are compared bit for bit inside their valid regions (padding masked); a difference is
then located in the format's row layout, where every entry maps to global rows, a scale block
and the rank whose shard held those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qgather.formats import Format, QuantizedTensor
from qgather.instruments import fused
from qgather.model.case import ShardLayout
from qgather.model.records import BufferDiff, Comparison, DiffProblem

MAP_WIDTH = 64  # block rows per text-map line


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view with the same bytes, so that comparisons are bitwise (NaN == NaN, -0 != 0).
    A view of the same element size: no copy, whatever the strides (a transposed golden buffer)."""
    t = t.detach()
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


class Pending(Protocol):
    """A comparison launched on the device whose counts are not read yet: `counts` are 0-dim device
    tensors, `resolve` makes the result from their values. Read with `read_together`, several
    comparisons cost one wait for the device instead of one each."""

    counts: list[torch.Tensor]

    def resolve(self, values: list[int]) -> Any: ...


def read_together(*pending: Pending | None) -> list:
    """Each comparison's result (None for None), all their counts read with one copy per device."""
    values = iter(_to_host([count for p in pending if p is not None for count in p.counts]))
    return [None if p is None else p.resolve([next(values) for _ in p.counts]) for p in pending]


def compare_buffers(got: dict[str, torch.Tensor], golden: QuantizedTensor) -> list[BufferDiff]:
    """Each of the golden's buffers that `got` lacks, holds in another shape or element size, or
    whose valid region differs in any bit (padding is never compared): `launch_buffers`, read."""
    return read_together(launch_buffers(got, golden))[0]


@dataclass
class PendingBuffers:
    """`launch_buffers`' comparison: what the host already found (a buffer missing, of another shape
    or element size) and the differing-word count of every other region, on its device."""

    found: list[BufferDiff]
    regions: list[tuple[str, torch.Tensor, torch.Tensor]]  # (name, gathered bits, golden bits)
    counts: list[torch.Tensor]
    order: list[str]  # the golden's buffer names: the order of the result

    def resolve(self, words: list[int]) -> list[BufferDiff]:
        diffs = list(self.found)
        for (name, a, b), n in zip(self.regions, words, strict=True):
            if n:  # the word count says only that the region differs: the report counts elements
                diffs.append(BufferDiff(name, DiffProblem.BITS, n_diff=int(_count_differing(a, b)), n_valid=a.numel()))
        return sorted(diffs, key=lambda d: self.order.index(d.name))


def launch_buffers(got: dict[str, torch.Tensor], golden: QuantizedTensor) -> PendingBuffers:
    """compare_buffers without waiting: every valid region compared where the gathered buffer lives,
    in one pass, its count left on the device; a region that differs is counted again element by
    element when the counts are read (PendingBuffers.resolve)."""
    found, regions, counts = [], [], []
    for name, want in golden.buffers.items():
        have = got.get(name)
        if have is None:
            found.append(BufferDiff(name, DiffProblem.MISSING, detail="(the implementation has no such buffer)"))
        elif tuple(have.shape) != tuple(want.shape):
            shapes = f"{tuple(have.shape)} != golden {tuple(want.shape)}"
            found.append(BufferDiff(name, DiffProblem.SHAPE, detail=shapes))
        elif have.dtype != want.dtype and have.element_size() != want.element_size():
            found.append(BufferDiff(name, DiffProblem.DTYPE, detail=f"{have.dtype} != golden {want.dtype}"))
        else:
            region = golden.valid[name]
            a, b = _bits(have[region]), _bits(want[region]).view(_bits(have).dtype)
            regions.append((name, a, b))
            counts.append(_differing_words(a, b))
    return PendingBuffers(found, regions, counts, list(golden.buffers))


def _to_host(counts: list[torch.Tensor]) -> list[int]:
    """Device counts as ints, with one copy (one wait) per device instead of one per count."""
    values: dict[int, int] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, count in enumerate(counts):
        by_device.setdefault(count.device, []).append(i)
    for indexes in by_device.values():
        for i, value in zip(indexes, torch.stack([counts[i] for i in indexes]).tolist()):
            values[i] = value
    return [values[i] for i in range(len(counts))]


def _differing_words(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many words of the two regions' bytes differ, on a's device, without waiting: the
    widest integer view both contiguous regions allow (a large buffer is read as 8-byte words,
    so the comparison's temporary is an eighth of it; on a GPU one kernel with none, fused.py);
    element by element where one is a strided view or on another device. Zero exactly when every
    bit agrees."""
    if a.dim() == 0 or b.device != a.device or not (a.is_contiguous() and b.is_contiguous()):
        return _count_differing(a, b)  # a golden waiting on the host comes over block by block
    wa, wb = _widest(a), _widest(b)
    if wa.dtype == wb.dtype and fused.large_pair(wa, wb):
        count = fused.count_differing(wa, wb)
        if count is not None:
            return count
    return _counted_in_row_chunks(wa, wb, _WORD_CHUNK)


_WORD_CHUNK = 1 << 26  # words per pass: bounds the comparison's boolean temporary to 64 MiB
_DEVICE_CHUNK = 1 << 22  # elements per pass of an element-by-element count: bounds its temporary


def _widest(t: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor's bytes as the widest integer words that divide them, flat."""
    flat = t.reshape(-1).view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if flat.numel() % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat


def _count_differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements whose bits differ (a 0-dim tensor on a's device: read it when needed), counted in
    blocks of rows: the boolean mask of a large buffer would be as large as the buffer itself. A
    large pair on a GPU (e.g. a transposed golden view) is counted by one kernel (fused.py)."""
    if fused.large_pair(a, b):
        count = fused.count_differing(a, b)
        if count is not None:
            return count
    if a.dim() == 0:
        return (a != b.to(a.device)).sum()
    return _counted_in_row_chunks(a, b, max(1, _DEVICE_CHUNK // max(1, a[0].numel())))


def _counted_in_row_chunks(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    """Elements of a and b (b brought to a's device chunk by chunk) whose bits differ, `rows` of their
    first dimension at a time; in one pass (two operations, e.g. a scale buffer) when they fit in one."""
    if a.shape[0] <= rows:
        return (a != b.to(a.device)).sum()
    total = torch.zeros((), dtype=torch.int64, device=a.device)
    for start in range(0, a.shape[0], rows):
        total += (a[start:start + rows] != b[start:start + rows].to(a.device)).sum()
    return total


def compare_values(got: torch.Tensor, want: torch.Tensor, rel_tol: float | None = None) -> Comparison:
    """Bitwise equality plus the size of the largest difference, for the report. With `rel_tol`
    (for outputs computed by another kernel than the golden's), differences up to
    rel_tol * max|want| count as equal, and the tolerance is part of the result. Runs on `want`'s
    device; only the counts leave it (`launch_values`, read)."""
    return read_together(launch_values(got, want, rel_tol))[0]


@dataclass
class PendingValues:
    """`launch_values`' comparison: the count of differing elements on the device, or the shape
    mismatch that decided it on the host."""

    got: torch.Tensor
    want: torch.Tensor
    rel_tol: float | None
    counts: list[torch.Tensor]
    decided: Comparison | None = None

    def resolve(self, values: list[int]) -> Comparison:
        if self.decided is not None:
            return self.decided
        (n_diff,) = values
        got, want = self.got, self.want
        max_abs = 0.0
        if n_diff:
            differ = _bits(got) != _bits(want)
            max_abs = float((got[differ].float() - want[differ].float()).abs().nan_to_num(float("inf")).max())
        if self.rel_tol is None:
            return Comparison(n_diff == 0, n_diff, max_abs)
        bound = self.rel_tol * float(want.abs().max()) if want.numel() else 0.0
        return Comparison(max_abs <= bound, n_diff, max_abs, f"|diff| <= {self.rel_tol:g} * max|golden| = {bound:.3g}")


def launch_values(got: torch.Tensor, want: torch.Tensor, rel_tol: float | None = None) -> PendingValues:
    """compare_values without waiting: the differing elements counted on want's device."""
    if got.shape != want.shape:
        return PendingValues(got, want, rel_tol, [], _shape_mismatch(got))
    got, want = _aligned(got, want)
    # same dtype: equal bits <=> equal float32 values
    return PendingValues(got, want, rel_tol, [differing_bits(got, want)])


def differing_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements of two tensors of one shape and dtype whose bits differ: a 0-dim count on a's device,
    not read (no wait)."""
    return (_bits(a) != _bits(b)).sum()


def _aligned(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(got, want) of one shape on want's device, in one dtype."""
    got, want = got.detach().to(want.device), want.detach()
    if got.dtype != want.dtype or not got.dtype.is_floating_point:
        got, want = got.float(), want.float()
    return got, want


def _shape_mismatch(got: torch.Tensor) -> Comparison:
    return Comparison(False, -1, float("inf"), detail=f"shape {tuple(got.shape)}")


@dataclass(frozen=True)
class Deferred:
    """Values not made yet, `fn(*tensors)` of `shape` (a golden's row block: Format.dequantize_rows_parts),
    for a comparison that on a GPU never holds them: one kernel dequantizes and compares (fused.py)."""

    fn: Callable[..., torch.Tensor]
    tensors: tuple[torch.Tensor, ...]
    shape: torch.Size

    def values(self) -> torch.Tensor:
        return self.fn(*self.tensors)


Block = tuple[torch.Tensor, "torch.Tensor | Deferred"]


def compare_value_blocks(pairs: Callable[[], Iterable[Block]]) -> Comparison:
    """compare_values over (got, want) blocks of one tensor, as one comparison (bitwise; the
    first block of another shape decides): `launch_value_blocks`, read."""
    return read_together(launch_value_blocks(pairs))[0]


@dataclass
class PendingValueBlocks:
    """`launch_value_blocks`' comparison: each block's count on the device, or the shape mismatch
    that decided it. Only when some differ are the blocks made again (`pairs()` once more), for
    the largest difference."""

    pairs: Callable[[], Iterable[Block]]
    counts: list[torch.Tensor]
    decided: Comparison | None = None

    def resolve(self, values: list[int]) -> Comparison:
        if self.decided is not None:
            return self.decided
        n_diff = sum(values)
        if not n_diff:
            return Comparison(True, 0, 0.0)
        max_abs = 0.0
        for got, want in self.pairs():
            max_abs = max(max_abs, compare_values(got, _made(want)).max_abs)
            del got, want
        return Comparison(False, n_diff, max_abs)


def launch_value_blocks(pairs: Callable[[], Iterable[Block]]) -> PendingValueBlocks:
    """compare_value_blocks without waiting: `pairs` makes the blocks, one at a time; each block's
    count stays on the device; a large Deferred block on a GPU is counted without its values existing."""
    counts = []
    for got, want in pairs():
        if tuple(got.shape) != tuple(want.shape):
            return PendingValueBlocks(pairs, [], _shape_mismatch(got))
        counts.append(_differing_values(got, want))
        del got, want  # not held while the next block is made
    return PendingValueBlocks(pairs, counts)


def _made(want: torch.Tensor | Deferred) -> torch.Tensor:
    return want.values() if isinstance(want, Deferred) else want


def _differing_values(got: torch.Tensor, want: torch.Tensor | Deferred) -> torch.Tensor:
    """Elements of `got` whose bits differ from `want`'s (in float32 where their dtypes differ), on
    want's device, without waiting."""
    if isinstance(want, Deferred):
        count = fused.count_differing_values(got, want.fn, want.tensors)
        if count is not None:
            return count
    got, want = _aligned(got, _made(want))
    return differing_bits(got, want)


def locate(
    fmt: Format,
    got: QuantizedTensor,
    golden: QuantizedTensor,
    shards: ShardLayout,
) -> list[str]:
    """Where the gathered buffers differ: first difference and a block-row map, in row layout."""
    try:
        got_rows, _ = fmt.to_rows(got)
    except Exception as exc:  # a wrong shape can make even the re-layout impossible
        return [f"(cannot map the difference to rows: {exc})"]
    want_rows, _ = fmt.to_rows(golden)
    lines = []
    for name, want in want_rows.items():
        have = got_rows.get(name)
        if have is None or have.shape != want.shape:
            continue
        differ = (_bits(have.to(want.device)) != _bits(want)).reshape(want.shape[0], -1).any(dim=1)
        if not bool(differ.any()):
            continue
        r = fmt.rows_per_entry[name]
        entries = differ.nonzero().flatten().tolist()
        first = entries[0]
        col = int((_bits(have.to(want.device))[first] != _bits(want[first])).reshape(-1).nonzero()[0])
        row = first * r
        if hasattr(shards, "owner_of_col"):  # Shard(1): the column says which rank sent it
            width = max(1, want.reshape(want.shape[0], -1).shape[1])
            owner = shards.owner_of_col(col * shards.cols // width)
        else:
            owner = shards.owner_of_row(row)
        lines.append(
            f"{name}: {len(entries)} of {want.shape[0]} row groups differ; first at global row {row}"
            f" (block row {row // fmt.row_block}, block column {_block_column(name, want_rows, col)},"
            f" from rank {owner})"
        )
        lines.extend(_block_map(fmt, differ, r, shards))
    return lines


def _block_column(name: str, rows: dict[str, torch.Tensor], col: int) -> int:
    """The scale-block column of element `col` of a row-layout buffer (data columns per scale)."""
    scale = rows.get(name.replace("data", "scale_inv"))
    if "scale" in name or scale is None or scale.dim() < 2 or scale.shape[-1] == 0:
        return col
    return col // max(1, rows[name].shape[-1] // scale.shape[-1])


def _block_map(fmt: Format, differ_entries: torch.Tensor, r: int, shards: ShardLayout) -> list[str]:
    """One character per scale-block row: '.' equal, else the rank whose shard held it."""
    rows_per_block = max(fmt.row_block, r)
    per_block = max(1, rows_per_block // r)
    n_blocks = -(-differ_entries.numel() // per_block)
    padded = torch.zeros(n_blocks * per_block, dtype=torch.bool)
    padded[: differ_entries.numel()] = differ_entries.cpu()
    block_differs = padded.view(n_blocks, per_block).any(dim=1).tolist()
    marks = "".join(
        _rank_mark(shards.owner_of_row(b * rows_per_block)) if d else "." for b, d in enumerate(block_differs)
    )
    lines = [f"  block rows ({rows_per_block} rows each; '.' equal, else source rank of the differing block):"]
    for start in range(0, len(marks), MAP_WIDTH):
        lines.append(f"  {start:>6} {marks[start:start + MAP_WIDTH]}")
    return lines if len(lines) <= 9 else [*lines[:8], f"  ... ({len(marks)} block rows in all)"]


def _rank_mark(rank: int) -> str:
    return "0123456789abcdefghijklmnopqrstuvwxyz"[rank] if rank < 36 else "#"
