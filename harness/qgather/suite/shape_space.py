"""The suite's shapes, generated from each format's own layout rules.

Every buffer of a format has, along the rows of x (M, the dimension FSDP2 shards) and along its
columns (K), a *unit* (elements of x per buffer entry: a scale block, two rows packed in a byte)
and a *padding multiple* (TE pads the entry count to it, e.g. 128 scale rows). Both are read off
the format's `buffer_specs` / `valid_regions` by probing (`buffer_facts`), so a format added later
gets its regimes without a table here.

A *regime* is one property of a (shape, world size) for one buffer, with FSDP2's dim-0 chunking
(torch.chunk semantics, `qgather.model.case.ShardLayout`); a case hits every regime that holds for it:

  rows:aligned       every non-empty shard starts on an entry boundary      (unit > 1)
  rows:split         some shard starts inside an entry (a block straddles two ranks)
  rows:tail-whole    M is a multiple of the unit                            (unit > 1)
  rows:tail-partial  the last entry of the tensor is partial
  rows:pad-filled    every rank holds rows, and each shard's entry count is a multiple of the padding (pad > 1)
  rows:pad-padded    some shard's buffer carries padding rows (or some rank holds none)
  cols:tail-whole / cols:tail-partial   K mod the unit                      (unit > 1)
  cols:pad-filled / cols:pad-padded     ceil(K / unit) mod the padding      (pad > 1)

and, for the whole shape (buffer "*"): even / uneven (dim 0 mod the world size), zero-row (some
rank holds no rows), m<ws (dim 0 below the world size), 3d (an expert weight), unholdable (a shape
the format cannot hold: its K or M off the format's multiple; the case must be REJECTED or EXACT).
A holdable shape has no "unholdable" regime and an unholdable one only that one.

The *space* of a (format, world size) is a fixed pool of candidate shapes built from those units
and paddings (`candidates`); a regime is *promised* at a world size when some candidate hits it.
The generator (`cover`) keeps the hand-picked shapes (`qgather.suite.sweeps.alignment_shapes`, whose ids
baselines and docs reference) and adds the cheapest candidates, greedily, until every promised
regime of every buffer is hit. `qgather.suite.coverage` prints which cells a run hits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from qgather.formats import FORMATS, FormatError
from qgather.formats.base import flat_dims
from qgather.model.case import ShardLayout

ROWS, COLS = "rows", "cols"
SHAPE = "*"  # the buffer name of regimes of the whole shape
#: candidates larger than this many elements stay out of the space (2-core CI; virtual worlds of 1024)
MAX_ELEMENTS = 1 << 20
_PROBE = 1024  # a multiple of every block; probing shapes are multiples of it

Cell = tuple[str, str]  # (buffer, regime)


@dataclass(frozen=True)
class Axis:
    unit: int  # elements of x per buffer entry along this axis
    pad: int  # the buffer's entry count is padded to a multiple of this


@dataclass(frozen=True)
class BufferFacts:
    name: str
    rows: Axis | None
    cols: Axis | None


@cache
def buffer_facts(fmt_name: str) -> tuple[BufferFacts, ...]:
    """Each buffer's unit and padding multiple along rows and columns of x (per-tensor buffers left out)."""
    fmt = FORMATS[fmt_name]
    gm, gk = math.lcm(fmt.m_multiple, 2), fmt.k_multiple
    m0, k0 = math.lcm(gm, _PROBE), math.lcm(gk, _PROBE)
    base, taller, wider = _extents(fmt, m0, k0), _extents(fmt, 2 * m0, k0), _extents(fmt, m0, 2 * k0)
    out = []
    for name, dims in base.items():
        axes: dict[str, Axis] = {}
        for i, (valid, _padded) in enumerate(dims):
            if taller[name][i][0] != valid:
                axes[ROWS] = Axis(m0 // valid, _padding(fmt, name, i, lambda n: (n * gm, k0)))
            elif wider[name][i][0] != valid:
                axes[COLS] = Axis(k0 // valid, _padding(fmt, name, i, lambda n: (m0, n * gk)))
        if axes:
            out.append(BufferFacts(name, axes.get(ROWS), axes.get(COLS)))
    return tuple(out)


def _extents(fmt, m: int, k: int) -> dict[str, list[tuple[int, int]]]:
    """(valid, padded) extent of each dim of each buffer for an (m, k) tensor."""
    specs, valid = fmt.buffer_specs((m, k)), fmt.valid_regions((m, k))
    return {name: [(s.stop - s.start, n) for s, n in zip(valid[name], shape)] for name, (shape, _) in specs.items()}


def _padding(fmt, name: str, dim: int, shape_of) -> int:
    """The multiple a buffer dim is padded to: the gcd of its padded extents where they exceed the valid one."""
    padded = []
    for n in range(1, 17):
        valid, extent = _extents(fmt, *shape_of(n))[name][dim]
        if extent != valid:
            padded.append(extent)
    return math.gcd(*padded) if padded else 1


# ---------------------------------------------------------------------------------------- regimes


@cache
def regimes(fmt_name: str, shape: tuple[int, ...], world_size: int) -> frozenset[Cell]:
    """The (buffer, regime) cells a case of this shape at this world size hits."""
    fmt = FORMATS[fmt_name]
    try:
        fmt.check(shape)
    except FormatError:
        return frozenset({(SHAPE, "unholdable")})
    layout = ShardLayout(shape[0], world_size, math.prod(shape[1:-1]))
    # torch.chunk: `held` ranks hold rows, all `full` rows but the last, which holds `last`
    held = math.ceil(shape[0] / layout.chunk)
    full, last = layout.chunk * layout.inner_rows, (shape[0] - (held - 1) * layout.chunk) * layout.inner_rows
    cells = {(SHAPE, "even" if layout.even else "uneven")}
    cells |= {(SHAPE, name) for name, hit in (("zero-row", held < world_size),
                                               ("m<ws", shape[0] < world_size), ("3d", len(shape) == 3)) if hit}
    m, k = flat_dims(tuple(shape))
    sizes = [full] * (held > 1) + [last]
    for buf in buffer_facts(fmt_name):
        if buf.rows:
            cells |= {(buf.name, r) for r in _row_regimes(buf.rows, m, full if held > 1 else 0, sizes,
                                                          held == world_size)}
        if buf.cols:
            cells |= {(buf.name, r) for r in _col_regimes(buf.cols, k)}
    return frozenset(cells)


def _row_regimes(axis: Axis, m: int, stride: int, sizes: list[int], every_rank: bool) -> list[str]:
    """stride: rows between shard starts (0: one shard); sizes: the distinct non-empty shard sizes."""
    out = []
    if axis.unit > 1:
        out.append("rows:split" if stride % axis.unit else "rows:aligned")
        out.append("rows:tail-partial" if m % axis.unit else "rows:tail-whole")
    if axis.pad > 1:
        filled = every_rank and not any(math.ceil(n / axis.unit) % axis.pad for n in sizes)
        out.append("rows:pad-filled" if filled else "rows:pad-padded")
    return out


def _col_regimes(axis: Axis, k: int) -> list[str]:
    out = []
    if axis.unit > 1:
        out.append("cols:tail-partial" if k % axis.unit else "cols:tail-whole")
    if axis.pad > 1:
        out.append("cols:pad-padded" if math.ceil(k / axis.unit) % axis.pad else "cols:pad-filled")
    return out


# ------------------------------------------------------------------------------------ the space

STD_K = 64  # qgather.suite.sweeps.K: the K of the hand-picked shapes


def _row_quanta(fmt_name: str) -> set[int]:
    fmt = FORMATS[fmt_name]
    quanta = {1, 2, fmt.row_block, fmt.m_multiple}
    for buf in buffer_facts(fmt_name):
        if buf.rows:
            quanta |= {buf.rows.unit, buf.rows.unit * buf.rows.pad}
    return quanta


def _ks(fmt_name: str) -> set[int]:
    fmt = FORMATS[fmt_name]
    ks = {STD_K, 2 * STD_K}
    if fmt.k_multiple > 1:
        ks.add(fmt.k_multiple + fmt.k_multiple // 2)  # off the format's K multiple: unholdable
    for buf in buffer_facts(fmt_name):
        if buf.cols:
            u, p = buf.cols.unit, buf.cols.pad
            c = math.ceil(16 / (u * p))  # entries fill the padding, and one entry more, at K >= 16
            ks |= {u * p * c, u * p * c + u}
            if u > 1:
                ks |= {u + u // 2, u * p + u // 2}
    return {k for k in ks if k >= 16}  # GEMM-friendly K, as the hand-picked shapes


@cache
def candidates(fmt_name: str, world_size: int) -> tuple[tuple[int, ...], ...]:
    """The pool of shapes of a (format, world size), up to MAX_ELEMENTS elements each."""
    ws = world_size
    quanta = _row_quanta(fmt_name)
    rows = {1, 2, 3, 4, ws // 2, ws - 1, ws, ws + 1} - {0}
    for q in quanta:
        for a in {1, ws, 2 * ws, ws + 1, max(ws - 1, 1)}:
            rows |= {a * q + r for r in (-2, -1, 0, 1, 2, q // 2)}
    ks = _ks(fmt_name)
    shapes = {(m, k) for m in rows for k in ks if m > 0}
    experts = {1, 2, 3, 4, ws - 1, ws, ws + 1, 2 * ws}
    shapes |= {(e, inner, k) for e in experts if e > 0 for inner in quanta if inner > 1 for k in (STD_K, *ks)}
    return tuple(sorted(s for s in shapes if math.prod(s) <= MAX_ELEMENTS))


@cache
def promised(fmt_name: str, world_size: int) -> frozenset[Cell]:
    """Every cell some candidate of the space hits: what the generated shapes must hit."""
    return frozenset().union(*(regimes(fmt_name, s, world_size) for s in candidates(fmt_name, world_size)))


@cache
def cover(fmt_name: str, world_size: int, keep: tuple[tuple[int, ...], ...] = ()) -> tuple[tuple[int, ...], ...]:
    """`keep` plus the cheapest candidates, chosen greedily, until every promised cell is hit."""
    chosen = list(keep)
    hit = set().union(*(regimes(fmt_name, s, world_size) for s in keep)) if keep else set()
    todo = set(promised(fmt_name, world_size)) - hit
    pool = {s: regimes(fmt_name, s, world_size) & todo for s in candidates(fmt_name, world_size)}
    while todo:
        best = max(pool, key=lambda s: (len(pool[s] & todo) / max(math.prod(s), 1024), -len(s), _neg(s)))
        chosen.append(best)
        todo -= pool.pop(best)
    return tuple(chosen)


def _neg(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-d for d in shape)  # ties: the smaller shape


def hit_cells(fmt_name: str, shapes: Iterable[tuple[int, ...]], world_size: int) -> frozenset[Cell]:
    return frozenset().union(*(regimes(fmt_name, tuple(s), world_size) for s in shapes))
