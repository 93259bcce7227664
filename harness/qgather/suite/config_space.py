"""The space of a configuration design (qgather.suite.config_sweep), per format: every case its
factors can make, which of them can run, the shape that produces each regime under each
configuration, the two-way label pairs its cases can hold (`achievable`: what the design must cover
and `qgather coverage` promises) and why every other pair cannot occur (`impossible`).

A design's factors are the regime (qgather.suite.config_regimes), the world size, the scenario, the
dtype and one value of each configuration component ("" is FSDP2's default). A *row* picks one
value of each; it is valid when FSDP2 can run it (qgather.model.config, qgather.model.fsdp_rules),
it is not the same gather as another row (a mixed-precision policy that casts nothing), and some
shape of the format's space (qgather.suite.shape_space.candidates) has that regime under that
configuration. Its case carries that shape, chosen among those with the regime: first not splitting
a block unless the regime is `split` (a split makes a rejection acceptable, which would hide what
else the case tests), then with the fewest other regimes, the hand-picked shapes first
(qgather.suite.sweeps.alignment_shapes, whose ids baselines name), then the fewest elements.

A label is (dimension, value): ("regime", r) for every regime the case hits (not only the one its
row asked for), ("ws", n), ("scenario", s), ("dtype", d) and (component name, token). A pair is two
labels of different dimensions; a pair is achievable when some valid row's case holds it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache
from itertools import combinations, product

from qgather.formats import FORMATS, FormatError
from qgather.model.case import CaseSpec, shard_world_size
from qgather.model.config import ConfigError, FsdpConfig
from qgather.model.fsdp_rules import fsdp_skip_reason
from qgather.suite import shape_space
from qgather.suite.config_regimes import REGIMES, block_units, case_regimes, combined, placement_regimes
from qgather.suite.sweeps import K, alignment_shapes

#: the largest shape of the space a row may run, beyond the preferred ones (2-core CI: the cheap end
#: of qgather.suite.shape_space's candidates, which go up to 2^20 elements)
MAX_ELEMENTS = 1 << 15

Label = tuple[str, object]
Pair = tuple[Label, Label]
REGIME, WS, SCENARIO, DTYPE = "regime", "ws", "scenario", "dtype"


@dataclass(frozen=True)
class Component:
    """One configuration dimension of a design: its tokens, "" (FSDP2's default) first."""

    name: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Design:
    """The factors of a configuration sweep. `configured_only`: every case carries one of its tokens
    (FSDP2's default configuration belongs to the shape sweeps, qgather.suite.sweeps)."""

    name: str
    components: tuple[Component, ...]
    world_sizes: tuple[int, ...]
    scenarios: tuple[str, ...]
    dtypes: tuple[str, ...]
    configured_only: bool = False

    @property
    def dimensions(self) -> tuple[str, ...]:
        return (REGIME, WS, SCENARIO, DTYPE, *(c.name for c in self.components))

    def values(self, dimension: str) -> tuple:
        fixed = {REGIME: REGIMES, WS: self.world_sizes, SCENARIO: self.scenarios, DTYPE: self.dtypes}
        if dimension in fixed:
            return tuple(fixed[dimension])
        return next(c.values for c in self.components if c.name == dimension)

    def config(self, tokens: tuple[str, ...]) -> FsdpConfig:
        return _parse("+".join(t for t in tokens if t))

    def tokens(self, config: FsdpConfig) -> tuple[str, ...] | None:
        """The component values of a configuration, or None if it has a token no component holds."""
        out = {c.name: "" for c in self.components}
        for part in filter(None, config.token.split("+")):
            owner = next((c for c in self.components if part in c.values), None)
            if owner is None or out[owner.name]:
                return None
            out[owner.name] = part
        return tuple(out[c.name] for c in self.components)


@cache
def _parse(token: str) -> FsdpConfig:
    return FsdpConfig.parse(token)


@dataclass(frozen=True)
class Row:
    """One point of a design's space: the regime asked for, and the case that has it."""

    regime: str
    spec: CaseSpec
    labels: frozenset[Label]


def case_labels(design: Design, spec: CaseSpec) -> frozenset[Label] | None:
    """The labels of a case in a design, or None when the design cannot express it."""
    tokens = design.tokens(spec.config)
    if tokens is None or spec.world_size not in design.world_sizes or spec.scenario not in design.scenarios:
        return None
    if spec.dtype not in design.dtypes or (design.configured_only and spec.config.is_default):
        return None
    labels = {(WS, spec.world_size), (SCENARIO, spec.scenario), (DTYPE, spec.dtype)}
    labels |= {(REGIME, r) for r in _regimes_of(spec)}
    labels |= {(c.name, t) for c, t in zip(design.components, tokens)}
    return frozenset(labels)


def pairs_of(labels: frozenset[Label]) -> Iterator[Pair]:
    for a, b in combinations(sorted(labels, key=repr), 2):
        if a[0] != b[0]:
            yield a, b


# ------------------------------------------------------------------ rows


@dataclass(frozen=True)
class Invalid:
    """Rows that cannot run, and why: every row whose labels include `declared` (a regime too when
    `regime` is set; any regime when it is None: the configuration, world size and dtype fail first)."""

    declared: frozenset[Label]
    regime: str | None
    reason: str

    def holds(self, pair: Pair) -> bool:
        return all(label in self.declared or label[0] == SCENARIO or (label[0] == REGIME and self.regime is None)
                   or label == (REGIME, self.regime) for label in pair)


@cache
def rows(design: Design, fmt: str) -> tuple[Row, ...]:
    """Every valid row of the design for one format, in factor order."""
    return _space(design, fmt)[0]


@cache
def _space(design: Design, fmt: str) -> tuple[tuple[Row, ...], tuple[Invalid, ...]]:
    valid: list[Row] = []
    invalid: list[Invalid] = []
    for tokens, ws, dtype in product(product(*(c.values for c in design.components)), design.world_sizes,
                                     design.dtypes):
        declared = frozenset({(WS, ws), (DTYPE, dtype)} | set(zip((c.name for c in design.components), tokens)))
        reason = _config_problem(design, tokens, ws, dtype)
        if reason:
            invalid.append(Invalid(declared, None, reason))
            continue
        config = design.config(tokens)
        for regime in REGIMES:
            spec, reason = _regime_case(fmt, ws, dtype, config, regime)
            if reason:
                invalid.append(Invalid(declared, regime, reason))
                continue
            labels = declared | {(REGIME, r) for r in _regimes_of(spec)}
            valid += [Row(regime, replace(spec, scenario=s), labels | {(SCENARIO, s)}) for s in design.scenarios]
    return tuple(valid), tuple(invalid)


def _regime_case(fmt: str, ws: int, dtype: str, config: FsdpConfig,
                 regime: str) -> tuple[CaseSpec | None, str | None]:
    """The case of a row (its scenario set later), or why there is none."""
    layout = layout_config(config)
    shape = representative(fmt, ws, layout, regime)
    if shape is None:
        return None, no_shape_reason(fmt, ws, layout, regime)
    spec = CaseSpec("reference", fmt, shape, dtype, ws, "gather", 0, config)
    reason = fsdp_skip_reason(spec)
    return (None, reason) if reason else (spec, None)


def _regimes_of(spec: CaseSpec) -> frozenset[str]:
    regimes = _holdable_regimes(spec.fmt, tuple(spec.shape), *_split_at(spec.world_size, layout_config(spec.config)))
    return case_regimes(spec) if regimes is None else regimes


def _config_problem(design: Design, tokens: tuple[str, ...], ws: int, dtype: str) -> str | None:
    """Why no case of these tokens, world size and dtype is a row, before any shape: FSDP2's rules that
    need no shape, and a mixed-precision policy that casts nothing (the same gather as without it)."""
    try:
        config = design.config(tokens)
    except ConfigError as exc:
        return str(exc)
    if design.configured_only and config.is_default:
        return "the default configuration belongs to the shape sweeps (qgather.suite.sweeps)"
    reason = config.check_world_size(ws) or compile_world_size_problem(config, ws)
    if reason:
        return reason
    saved = config.saved_at_world_size
    if saved is not None and config.saved_config.check_world_size(saved):
        return f"dcp-ws{saved}: the save runs at {saved} ranks, {config.saved_config.check_world_size(saved)}"
    if config.param_dtype == dtype:
        return (f"mp-{dtype} on {dtype} masters casts nothing: FSDP2 drops a param_dtype equal to the "
                "parameter's dtype, the gather is FSDP2's default one")
    return fsdp_skip_reason(_probe(config, ws))  # a shape every rule accepts: what remains holds for any shape


#: the most ranks a compiled case of a design runs at, unless its mesh needs more (hsdp-2x2: 4)
COMPILE_MAX_WORLD_SIZE = 2


def compile_world_size_problem(config: FsdpConfig, ws: int) -> str | None:
    """Why a compiled row does not run at `ws` ranks: every rank traces the same graph (Dynamo and
    AOTAutograd, ~0.25 s of CPU per rank on the 2-core CI machine), so a compiled case costs its world
    size in traces, while the graph sees the unsharded weight, the same at every world size; the
    gathers that differ by world size are eager (FSDP2's hooks) and judged at every size by the
    uncompiled rows. A compiled row runs at 1 or 2 ranks, or at the ranks its HSDP mesh needs."""
    if not config.compile or ws <= COMPILE_MAX_WORLD_SIZE or config.hsdp is not None:
        return None
    return (f"compile runs at up to {COMPILE_MAX_WORLD_SIZE} ranks (or an HSDP mesh's): each rank traces "
            "the same graph of the unsharded weight")


def _probe(config: FsdpConfig, ws: int) -> CaseSpec:
    """A case of this configuration on a 2-D shape every shard mesh of `ws` ranks splits evenly."""
    return CaseSpec("reference", "fp8_tensor", (16 * ws, K * ws), "bf16", ws, "gather", 0, config)


# ------------------------------------------------------------------ shapes


@cache  # computed once per configuration: `qgather list --cases` asks ~45,000 times
def layout_config(config: FsdpConfig) -> FsdpConfig:
    """The configuration without the settings that do not change where FSDP2 splits the weight (nor
    which shapes it can split): mixed precision, reshard_after_forward, compile, a trained save."""
    return replace(config, param_dtype=None, reduce_dtype=None, reshard_after_forward=True, compile=False,
                   saved_after_forward=False)


def _preferred(fmt: str) -> tuple[tuple[int, ...], ...]:
    """The shapes tried first: the two of the sweep before regimes (8 and 8.5 row blocks), then the
    hand-picked ones."""
    u = max(FORMATS[fmt].row_block, 16)
    k = 256 if fmt.startswith("fp8_block") else K
    old = [(8 * u, k), (17 * u // 2, k)]
    return tuple(dict.fromkeys([*old, *map(tuple, alignment_shapes(fmt))]))


@cache
def _pool(fmt: str, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The shapes of the space at these world sizes (up to MAX_ELEMENTS), preferred ones first, then by elements."""
    space = {s for n in sizes for s in shape_space.candidates(fmt, n) if math.prod(s) <= MAX_ELEMENTS}
    rest = sorted(space - set(_preferred(fmt)), key=lambda s: (math.prod(s), s))
    return (*_preferred(fmt), *rest)


@cache
def representatives(fmt: str, ws: int, config: FsdpConfig) -> dict[str, tuple[int, ...]]:
    """Per regime, the shape a row of that regime runs (see the module docstring), for a layout config."""
    sizes, bare = _split_at(ws, config)
    best: dict[str, tuple] = {}
    for index, shape in enumerate(_pool(fmt, tuple(sorted(set(sizes))))):
        hit = _holdable_regimes(fmt, shape, sizes, bare)
        if hit is None:
            continue
        for regime in hit:
            rank = (regime != "split" and "split" in hit, len(hit), index)
            if regime not in best or rank < best[regime][0]:
                best[regime] = (rank, shape)
    return {regime: shape for regime, (_rank, shape) in best.items()}


def representative(fmt: str, ws: int, config: FsdpConfig, regime: str) -> tuple[int, ...] | None:
    return representatives(fmt, ws, config).get(regime)


def _holdable_regimes(fmt: str, shape: tuple[int, ...], sizes: tuple[int, ...],
                      bare: FsdpConfig) -> frozenset[str] | None:
    """The regimes of a shape split at each of `sizes` under a configuration without a checkpoint
    (qgather.suite.config_regimes.case_regimes, each placement computed once); None when the format
    cannot hold it or FSDP2 cannot shard it so at one of them."""
    placed = [_placed(fmt, shape, size, bare) for size in sizes]
    return None if None in placed else combined(shape, placed)


@cache
def _split_at(ws: int, config: FsdpConfig) -> tuple[tuple[int, ...], FsdpConfig]:
    """The world sizes a case is split at (its own; a checkpoint's too) and its config without the checkpoint."""
    saved = config.saved_at_world_size
    return (ws, *((saved,) if saved else ())), replace(config, saved_at_world_size=None, saved_after_forward=False)


@cache
def _placed(fmt: str, shape: tuple[int, ...], ws: int, config: FsdpConfig) -> frozenset[str] | None:
    try:
        FORMATS[fmt].check(shape)
    except FormatError:
        return None
    spec = CaseSpec("reference", fmt, shape, "bf16", ws, "gather", 0, config)
    return None if fsdp_skip_reason(spec) else placement_regimes(spec)


# ------------------------------------------------------------------ pairs


@cache
def achievable(design: Design, fmt: str) -> frozenset[Pair]:
    """Every pair some valid row of the format holds: what the design covers and coverage promises."""
    return frozenset(p for row in rows(design, fmt) for p in pairs_of(row.labels))


def universe(design: Design) -> frozenset[Pair]:
    """Every pair of values of two dimensions of the design."""
    labels = [(d, v) for d in design.dimensions for v in design.values(d)]
    return frozenset(pairs_of(frozenset(labels)))


@cache
def impossible(design: Design, fmt: str) -> dict[Pair, str]:
    """Every pair of the universe no valid row of the format holds, with why: the reason of the rows
    that would hold it and got furthest (a regime's shape problem before a configuration's), the most
    frequent one among them."""
    _valid, invalid = _space(design, fmt)
    out = {}
    for pair in sorted(universe(design) - achievable(design, fmt), key=repr):
        matching = [i for i in invalid if i.holds(pair)]
        furthest = [i.reason for i in matching if i.regime is not None] or [i.reason for i in matching]
        out[pair] = Counter(furthest).most_common(1)[0][0] if furthest else "no row of the design holds it"
    return out


# ------------------------------------------------------------------ why a regime has no shape


def no_shape_reason(fmt: str, ws: int, config: FsdpConfig, regime: str) -> str:
    """Why no shape of the format's space has `regime` under `config` at `ws` ranks."""
    token = config.token or "the default configuration"
    return (_layout_reason(token, config, ws, regime) or _format_reason(fmt, config, regime)
            or f"no shape of the space (up to {MAX_ELEMENTS} elements) has it under {token} at {ws} ranks")


def _layout_reason(token: str, config: FsdpConfig, ws: int, regime: str) -> str | None:
    """Where the configuration splits the weight rules the regime out."""
    if config.shard_dim == 1 and regime in ("uneven", "zero-row", "m<ws"):
        return (f"{token}: FSDP2 shards K evenly or not at all (fully_shard raises on uneven Shard(1)), and every "
                "rank holds every row")
    if config.shard_dim == 1 and regime == "3d":
        return f"{token}: Shard(1) of a 3-D expert weight splits each expert's rows, not K (2-D weights only)"
    single = shard_world_size(_probe(config, ws)) == 1 and config.saved_at_world_size in (None, 1)
    if single and regime in ("uneven", "zero-row", "m<ws", "split"):
        return f"{token}: the weight is sharded over 1 rank, which holds all of it"
    return None


def _format_reason(fmt: str, config: FsdpConfig, regime: str) -> str | None:
    """The format's blocks rule the regime out along the sharded dimension."""
    if regime not in ("split", "tail-partial"):
        return None
    axis, along = ("cols", "K") if config.shard_dim == 1 else ("rows", "M")
    units = [u for u in block_units(fmt, axis) if u > 1]
    if not any(u > 1 for a in ("rows", "cols") for u in block_units(fmt, a)):
        return f"{fmt} has no scale block (a per-tensor scale): nothing to split or leave partial"
    if not units:
        return f"{fmt} has no block along {along}: nothing to split or leave partial there"
    multiple = FORMATS[fmt].k_multiple if axis == "cols" else FORMATS[fmt].m_multiple
    if regime == "tail-partial" and all(multiple % u == 0 for u in units):
        return f"{fmt} holds only {along} that are multiples of its {max(units)}-element block along {along}"
    return None
