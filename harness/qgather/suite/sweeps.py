"""The case sweeps that the suite (cases/, harness/qgather/cases/) runs: which shapes, world sizes
and scenarios, per format.

Shapes are derived from each format's row block b so that every format gets the same kinds of
cases: aligned shards, shards that split a scale block (e.g. 136x64 at 8 ranks for NVFP4:
17-row shards), dim 0 not divisible by the world size, ranks with zero rows, dim 0 smaller than
the world size, K the format cannot hold, and 3-D expert weights. On top of these hand-picked
shapes, qgather.suite.shape_space adds, per world size, shapes generated from the formats' layout rules
until every promised regime of every buffer occurs (RULE_SHAPES, the sweeps' default).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Protocol, TypeVar, runtime_checkable

from qgather.formats import FORMATS
from qgather.model.case import DTYPES, CaseSpec
from qgather.model.config import DEFAULT, FsdpConfig
from qgather.suite import covering, shape_space

T = TypeVar("T")


@runtime_checkable
class SuiteSweep(Protocol):
    """A case module's SWEEP, as the pytest plugin, `qgather list --cases` and `qgather coverage` use
    it: Sweep, CaseSet and qgather.suite.config_sweep.ConfigSweep declare it; a library's own test file
    may answer it without inheriting."""

    marks: Sequence[str]  # pytest marks on every case of the sweep
    world_sizes: Sequence[int]  # every world size it has cases at: --world-sizes is checked against these
    scenarios: Sequence[str]

    def cases(self, impls: Iterable[str], formats: Iterable[str] | None = None,
              world_sizes: Iterable[int] | None = None, scenarios: Iterable[str] | None = None,
              exhaustive: bool = False) -> list[CaseSpec]:
        """The default run's cases of `impls` (a covering design), or with `exhaustive` the full product,
        narrowed to the selected formats, world sizes and scenarios (None: all)."""
        ...


def narrow(values: Iterable[T], selection: Iterable[Hashable] | None,
           key: Callable[[T], Hashable] = lambda v: v) -> list[T]:
    """The values whose key a command-line selection names (None: all of them), in their order."""
    if selection is None:
        return list(values)
    chosen = set(selection)
    return [v for v in values if key(v) in chosen]


CPU_WORLD_SIZES = (1, 2, 3, 4, 8)

# K per format: a multiple of every format's K block, small enough for 2-core CI.
K = 64
# K values a format cannot hold (clean rejection expected), per format.
UNHOLDABLE_K = {"mxfp8": 48, "nvfp4_1d": 40, "nvfp4_2d": 40}


def alignment_shapes(fmt_name: str) -> list[tuple[int, ...]]:
    b = FORMATS[fmt_name].row_block
    # Sizes scale with the row block; per-tensor formats (b = 1) use 16-row units so that their
    # shapes are also ones GPU GEMMs accept (dims that are multiples of 16).
    u = max(b, 16)
    shapes = {
        (8 * u, K),  # aligned at 1, 2, 4 and 8 ranks; split blocks at 3
        (10 * u, K),  # even at 2 ranks; split blocks at 4 and 8
        (3 * u - 2, K),  # uneven at 3 ranks, aligned (chunks u, u, u-2) when b divides u
        (17 * u // 2, K),  # 136x64 for NVFP4: 17-row shards at 8 ranks
        (2 * u - 1, 2 * K),  # odd dim 0: uneven everywhere
        (4, K),  # dim 0 smaller than most world sizes: zero-row ranks
        (4, b, K),  # 3-D expert weights: FSDP2 shards the experts
        (3, b, K),  # 3-D, uneven expert split
    }
    if fmt_name.startswith("fp8_block"):
        shapes.add((200, 256))  # 128-row tiles split at 2 ranks (100-row shards)
    if fmt_name in UNHOLDABLE_K:
        shapes.add((8 * b, UNHOLDABLE_K[fmt_name]))
    return sorted(shapes)


def core_shapes(fmt_name: str) -> list[tuple[int, ...]]:
    """Four of the hand-picked shapes, one per shape class, in row units u = max(row block, 16): 8u
    (aligned at 2 and 8 ranks, split blocks at 3), 8.5u (shards that split a scale block), 3u-2
    (uneven at 2 and 3 ranks) and 4 rows (zero-row ranks at 8)."""
    u = max(FORMATS[fmt_name].row_block, 16)
    wanted = [(8 * u, K), (17 * u // 2, K), (3 * u - 2, K), (4, K)]
    return [s for s in wanted if s in set(alignment_shapes(fmt_name))]


class RuleShapes:
    """The suite's shapes: hand-picked ones (`alignment_shapes` by default, whose case ids baselines
    and docs name) at every world size, plus the shapes qgather.suite.shape_space generates from the
    format's layout rules so that every promised regime of every buffer occurs at each world size."""

    def __init__(self, hand_picked: Callable[[str], list[tuple[int, ...]]] = alignment_shapes) -> None:
        self.hand_picked = hand_picked

    def __call__(self, fmt_name: str) -> list[tuple[int, ...]]:
        return self.hand_picked(fmt_name)

    def at(self, fmt_name: str, world_size: int) -> list[tuple[int, ...]]:
        return list(shape_space.cover(fmt_name, world_size, tuple(self.hand_picked(fmt_name))))


RULE_SHAPES = RuleShapes()
#: every promised regime at each world size from the four `core_shapes` and the fewest generated ones:
#: for the sweeps whose depth is cheap (many world sizes, scenarios or seeds per shape), where the
#: other hand-picked shapes only repeat regimes the cover already holds
LEAN_SHAPES = RuleShapes(core_shapes)
#: the generated shapes alone: every promised regime at each world size, nothing hand-picked
RULES_ONLY = RuleShapes(lambda _fmt_name: [])


def _shapes_at(shapes, fmt: str, world_size: int) -> list[tuple[int, ...]]:
    at = getattr(shapes, "at", None)
    return [tuple(s) for s in (at(fmt, world_size) if at else shapes(fmt))]


@dataclass(frozen=True)
class Sweep(SuiteSweep):
    """Cases of formats x shapes x world sizes x scenarios (the rows, all run), with dtypes, seeds and
    FSDP2 configurations crossed pairwise (qgather.suite.covering), or fully with `exhaustive`; narrowed by
    the session's command-line options."""

    scenarios: Sequence[str]
    world_sizes: Sequence[int] = CPU_WORLD_SIZES
    dtypes: Sequence[str] = DTYPES
    shapes: object = RULE_SHAPES  # callable(fmt) -> shapes, or with .at(fmt, world_size) -> shapes
    formats: Sequence[str] | None = None
    seeds: Sequence[int] = (0,)
    configs: Sequence[FsdpConfig] = (DEFAULT,)
    marks: Sequence[str] = field(default_factory=tuple)

    def cases(
        self,
        impls: Iterable[str],
        formats: Iterable[str] | None = None,
        world_sizes: Iterable[int] | None = None,
        scenarios: Iterable[str] | None = None,
        exhaustive: bool = False,
    ) -> list[CaseSpec]:
        """The default run's cases (a covering design), or with `exhaustive` the full product.

        The design is made over the whole sweep, for any implementation, and then narrowed: a case id
        means the same case whichever selection (formats, world sizes, scenarios, impls) runs it."""
        combos = list(product(self.dtypes, self.seeds, self.configs))
        valid = lambda row, c: c[2].check_world_size(row[3]) is None
        if exhaustive or len(combos) == 1:
            rows = self.rows([""], formats, world_sizes, scenarios)
            chosen = [(row, c) for row in rows for c in combos if valid(row, c)]
        else:
            rows = self.rows([""])
            chosen = self._covering(rows, combos, valid)
            keep = set(self.rows([""], formats, world_sizes, scenarios))
            chosen = [rc for rc in chosen if rc[0] in keep]
        order = {row: i for i, row in enumerate(rows)}
        chosen.sort(key=lambda rc: (order[rc[0]], combos.index(rc[1])))
        return [CaseSpec(impl, fmt, shape, dtype, ws, scenario, seed, config)
                for impl in impls for (_, fmt, shape, ws, scenario), (dtype, seed, config) in chosen]

    def rows(self, impls, formats=None, world_sizes=None, scenarios=None) -> list[tuple]:
        """(impl, format, shape, world size, scenario) of every row, in the suite's order."""
        fmts = narrow(self.formats or FORMATS, formats)
        sizes = narrow(self.world_sizes, world_sizes)
        scens = narrow(self.scenarios, scenarios)
        out = []
        for impl in impls:
            for fmt in fmts:
                at = {ws: _shapes_at(self.shapes, fmt, ws) for ws in sizes}
                for shape in sorted(set().union(*at.values()) if at else ()):
                    out += [(impl, fmt, shape, ws, scen) for ws in sizes if shape in at[ws] for scen in scens]
        return out

    def _covering(self, rows, combos, valid) -> list[tuple]:
        legacy = {fmt: set(map(tuple, alignment_shapes(fmt))) for fmt in {row[1] for row in rows}}

        def fixed_labels(row):
            _impl, fmt, shape, ws, scen = row
            cells = shape_space.regimes(fmt, shape, ws)
            # scenario-at-world-size and scenario-of-format as values too: each seed (dtype, config) runs each
            # scenario at each world size and on each format
            labels = {("format", fmt), ("ws", ws), ("scenario", scen), ("scenario@ws", (scen, ws)),
                      ("scenario@format", (scen, fmt))}
            return frozenset(labels | {("regime", (fmt, *cell)) for cell in cells})

        def free_labels(combo):
            dtype, seed, config = combo
            return (("dtype", dtype), ("seed", seed), ("config", config.token))

        return covering.pairwise_over_rows(rows, combos, fixed_labels, free_labels, valid,
                                           pinned=lambda row: row[2] in legacy[row[1]],
                                           primary=lambda c: c[2] == self.configs[0])


@dataclass(frozen=True)
class CaseSet(SuiteSweep):
    """Several sweeps as one SWEEP; a case id two of them generate runs once (the first's)."""

    sweeps: Sequence[SuiteSweep]
    marks: Sequence[str] = field(default_factory=tuple)

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({w for sweep in self.sweeps for w in sweep.world_sizes}))

    @property
    def scenarios(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for sweep in self.sweeps for s in sweep.scenarios))

    def cases(self, impls: Iterable[str], formats=None, world_sizes=None, scenarios=None,
              exhaustive: bool = False) -> list[CaseSpec]:
        impls = list(impls)
        out: dict[str, CaseSpec] = {}
        for sweep in self.sweeps:
            for case in sweep.cases(impls, formats, world_sizes, scenarios, exhaustive=exhaustive):
                out.setdefault(case.id, case)
        return list(out.values())
