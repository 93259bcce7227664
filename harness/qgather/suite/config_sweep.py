"""The configuration sweeps: FSDP2 configurations (mixed precision, reshard_after_forward, HSDP
meshes, dim-1 sharding: `FSDP`) and checkpoint resharding / torch.compile (`CHECKPOINT`) crossed
with the shape regimes the formats' rules produce (qgather.suite.config_regimes), per format.

Each design is one table row per configuration component (`FSDP_COMPONENTS`,
`CHECKPOINT_COMPONENTS`) plus its world sizes, scenarios and dtypes. Its space
(qgather.suite.config_space) is every valid case of those factors, each on the shape that
produces its regime under its configuration; the default run is a covering design of that space
per format (qgather.suite.covering.cover_pairs): every pair of labels of two dimensions that some
valid case can hold, (configuration token, regime) per format included, occurs in at least one
case. `qgather coverage` shows those pairs and fails when one is missing (qgather.suite.config_coverage).
The full product of the space is the slow sweep.

A component added to a table (e.g. a tensor-parallel `tp-DxT`, whose token qgather.model.config
parses and whose FSDP2 rules qgather.model.fsdp_rules and qgather.model.case.shard_layout know)
enters the design, its pairs and the coverage as it is: nothing else here names a component.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from types import MappingProxyType

from qgather.formats import FORMATS
from qgather.model.case import CaseSpec
from qgather.suite.config_space import REGIME, Component, Design, Row, rows
from qgather.suite.covering import cover_pairs
from qgather.suite.sweeps import SuiteSweep, narrow

FSDP_COMPONENTS: tuple[Component, ...] = (
    Component("mp", ("", "mp-bf16", "mp-bf16-rfp32", "mp-fp32", "mp-fp32-rbf16")),
    Component("raf", ("", "raf-no", "raf-2", "raf-4")),  # an int runs only as 1 or the shard size (fsdp_rules)
    Component("hsdp", ("", "hsdp-2x2", "hsdp-1x2", "hsdp-2x1")),
    Component("dim", ("", "dim1")),
)
FSDP = Design("fsdp", FSDP_COMPONENTS, world_sizes=(2, 4), scenarios=("gather", "steps", "reshard"),
              dtypes=("bf16", "fp32"), configured_only=True)

CHECKPOINT_COMPONENTS: tuple[Component, ...] = (
    Component("dcp", ("", "dcp-ws1", "dcp-ws2", "dcp-ws3", "dcp-ws4", "dcp-ws2-trained")),
    Component("compile", ("", "compile")),
)
CHECKPOINT = Design("checkpoint", CHECKPOINT_COMPONENTS, world_sizes=(1, 2, 3, 4), scenarios=("gather",),
                    dtypes=("bf16",), configured_only=True)

#: torch.compile and the step paths (steps, reshard, a checkpoint resharded into them) crossed with
#: the other configuration tokens: every pair of them in some case (compile with a mixed-precision
#: policy, an HSDP step, a checkpoint loaded into a re-sharded step, ...)
STEP_PATHS_COMPONENTS: tuple[Component, ...] = (
    Component("mp", ("", "mp-bf16", "mp-fp32")),
    Component("raf", ("", "raf-no")),
    Component("hsdp", ("", "hsdp-2x2")),
    Component("dim", ("", "dim1")),
    Component("compile", ("", "compile")),
    Component("dcp", ("", "dcp-ws2", "dcp-ws4")),
)
STEP_PATHS = Design("step-paths", STEP_PATHS_COMPONENTS, world_sizes=(2, 4), scenarios=("steps", "reshard"),
                    dtypes=("bf16", "fp32"), configured_only=True)

#: every configuration design of the suite, for qgather.suite.config_coverage
DESIGNS: tuple[Design, ...] = (FSDP, CHECKPOINT, STEP_PATHS)

IMPL_FORMATS = {"torchao": ("fp8_tensor",)}  # implementations that hold only some formats

#: beside the reference in the default run: torchao, without the regimes where torchao 0.18's float8
#: all-gather is a known failure on gloo (docs/findings.md#torchao-uneven-shards; `--impl` runs them)
TORCHAO_BESIDE: Mapping[str, frozenset[str]] = MappingProxyType({"torchao": frozenset({"uneven", "zero-row", "m<ws"})})


#: the default run holds every (scenario, configuration token) pair of a design in cases of at least
#: this many regimes (all of them where its space has fewer): a bug that needs the pair shows on
#: several shapes of different regimes, not on the one case a pairwise design may give it
DEPTH = 3


@cache
def covering_rows(design: Design, fmt: str) -> tuple[Row, ...]:
    """The default run's rows of one format: a covering design of its space, deepened (`DEPTH`), in
    factor order."""
    space = rows(design, fmt)
    picked = deepened(design, space, cover_pairs([row.labels for row in space]))
    return tuple(space[i] for i in sorted(picked))


def scenario_tokens(design: Design, row: Row) -> set[tuple[str, str]]:
    """The (scenario, configuration token) pairs a row holds."""
    names = {c.name for c in design.components}
    return {(row.spec.scenario, value) for dimension, value in row.labels if dimension in names and value}


def deepened(design: Design, space: Sequence[Row], picked: Iterable[int]) -> set[int]:
    """`picked` (indices into `space`) plus rows until every (scenario, token) pair is held by DEPTH
    cases of different shapes and regimes (or of every regime the space has for it, as far as their
    shapes differ). Each addition serves the first short pair (sorted), preferring the row that
    serves the most short pairs, then one that compiles only where the pair is `compile` (a compiled
    forward costs the most), then the fewest elements."""
    chosen = set(picked)
    specs = {space[i].spec for i in chosen}  # two rows may ask for two regimes of one case: one case
    pairs = [scenario_tokens(design, row) for row in space]
    rows_of: dict[tuple[str, str], list[int]] = {}
    for i, row_pairs in enumerate(pairs):
        for pair in row_pairs:
            rows_of.setdefault(pair, []).append(i)
    held: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {pair: {} for pair in rows_of}  # regime -> shape

    def serves(i: int, pair: tuple[str, str]) -> bool:
        row = space[i]
        return row.regime not in held[pair] and row.spec.shape not in held[pair].values()

    def hold(i: int) -> None:
        for pair in pairs[i]:
            if serves(i, pair):
                held[pair][space[i].regime] = space[i].spec.shape

    for i in sorted(chosen):
        hold(i)
    want = {pair: min(DEPTH, len({space[i].regime for i in rows})) for pair, rows in rows_of.items()}

    def rank(i: int, pair: tuple[str, str]) -> tuple:
        gain = sum(1 for p in pairs[i] if len(held[p]) < want[p] and serves(i, p))
        extra_compile = space[i].spec.config.compile and pair[1] != "compile"
        return gain, not extra_compile, -math.prod(space[i].spec.shape), -i

    for pair in sorted(want):
        while len(held[pair]) < want[pair]:
            candidates = [i for i in rows_of[pair] if space[i].spec not in specs and serves(i, pair)]
            if not candidates:  # its other regimes are held only by shapes it already has
                break
            best = max(candidates, key=lambda i: rank(i, pair))
            chosen.add(best)
            specs.add(space[best].spec)
            hold(best)
    return chosen


@dataclass(frozen=True)
class ConfigSweep(SuiteSweep):
    """A design's cases: the covering rows per format (the product with `product` or exhaustive), for
    each implementation. The design is made per format over every world size and scenario and then
    narrowed to the selection, so a narrowed run's ids are a subset of the full run's (one
    known-issues baseline serves both), and a format's ids do not depend on the other formats.

    `companions`: implementations that run beside the plugin's default one (reference), each without
    the cases hitting the regimes given (where it is a known failure; `--impl` runs them all)."""

    design: Design
    product: bool = False
    marks: Sequence[str] = field(default_factory=tuple)
    companions: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return self.design.world_sizes

    @property
    def scenarios(self) -> tuple[str, ...]:
        return self.design.scenarios

    def cases(self, impls: Iterable[str], formats: Iterable[str] | None = None,
              world_sizes: Iterable[int] | None = None, scenarios: Iterable[str] | None = None,
              exhaustive: bool = False) -> list[CaseSpec]:
        impls = list(impls)
        leave_out = {impl: frozenset() for impl in impls}
        if impls == ["reference"]:
            leave_out.update(self.companions)
        sizes, scens = set(narrow(self.world_sizes, world_sizes)), set(narrow(self.scenarios, scenarios))
        # Two rows of the space may ask for two regimes of one case (one shape holds both): one case,
        # once (pytest would run it twice, under ids it suffixes one by one, quadratic in the ids).
        out: dict[str, CaseSpec] = {}
        for fmt in narrow(FORMATS, formats):
            chosen = rows(self.design, fmt) if self.product or exhaustive else covering_rows(self.design, fmt)
            chosen = [r for r in chosen if r.spec.world_size in sizes and r.spec.scenario in scens]
            for impl, left_out in leave_out.items():
                if fmt in IMPL_FORMATS.get(impl, FORMATS):
                    for r in chosen:
                        if not {v for d, v in r.labels if d == REGIME} & left_out:
                            spec = replace(r.spec, impl=impl)
                            out.setdefault(spec.id, spec)
        return list(out.values())
