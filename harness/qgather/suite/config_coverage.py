"""The configuration pairs of a run: for each configuration design (qgather.suite.config_sweep.DESIGNS)
and format, the two-way label pairs its cases hold (qgather.suite.config_space.case_labels), the pairs
promised and the pairs that cannot occur, with why.

A (design, format) promises every achievable pair of its space (qgather.suite.config_space.achievable)
when the run ran that design for that format: cases carrying one of its tokens at every world size and
scenario of the design (a selection narrowed to some of them runs part of a design, which promises its
pairs only as a whole). Any case the design can express counts as a hit, whichever sweep ran it (a
default-configuration case of the shape sweeps holds the pairs of FSDP2's defaults).

`qgather coverage` prints `markdown` under the shape-cell matrix (qgather.suite.coverage) and exits 1
on a missing pair; the pytest plugin prints `promise_lines` at the end of a session.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from qgather.model.case import CaseSpec
from qgather.suite.config_regimes import DESCRIPTIONS, REGIMES
from qgather.suite.config_space import REGIME, Design, Pair, achievable, case_labels, impossible, pairs_of
from qgather.suite.config_sweep import DESIGNS
from qgather.suite.memo import Memo

Key = tuple[str, str, Pair]  # design name, format, pair


@dataclass
class PairCoverage:
    hits: Counter = field(default_factory=Counter)  # Key -> cases holding the pair
    promised: set[Key] = field(default_factory=set)
    impossible: dict[Key, str] = field(default_factory=dict)  # of the (design, format)s the run has cases of
    not_promised: dict[tuple[str, str], str] = field(default_factory=dict)  # (design, format) -> why not
    designs: tuple[Design, ...] = DESIGNS

    @property
    def missing(self) -> list[Key]:
        return sorted((k for k in self.promised if not self.hits[k]), key=repr)


def measure(cases: Iterable[CaseSpec], designs: Iterable[Design] = DESIGNS, memo: Memo | None = None) -> PairCoverage:
    """The pairs `cases` hold in each design, and those promised (see the module docstring); `memo`:
    each design's achievable and impossible pairs from qgather.suite.memo where this source computed
    them before (a run's reports; a caller that patches the design's rules computes)."""
    cov = PairCoverage(designs=tuple(designs))
    cases = list(cases)
    for design in cov.designs:
        ran = _count_hits(cov, design, cases)
        everywhere = {(ws, s) for ws in design.world_sizes for s in design.scenarios}
        for fmt, places in sorted(ran.items()):
            cannot = _kept(memo, impossible, design, fmt)
            cov.impossible.update({(design.name, fmt, p): why for p, why in cannot.items()})
            if places == everywhere:
                cov.promised |= {(design.name, fmt, p) for p in _kept(memo, achievable, design, fmt)}
                continue
            left = sorted(everywhere - places)
            cov.not_promised[(design.name, fmt)] = (
                "the run has no configured case at " + ", ".join(f"ws{ws} {s}" for ws, s in left[:4])
                + (f" and {len(left) - 4} more" if len(left) > 4 else ""))
    return cov


def _kept(memo: Memo | None, pairs: Callable[[Design, str], Any], design: Design, fmt: str) -> Any:
    """`pairs(design, fmt)`, through `memo` when there is one (keyed by the design's whole repr)."""
    if memo is None:
        return pairs(design, fmt)
    return memo.value(repr((pairs.__name__, design, fmt)), lambda: pairs(design, fmt))


def _count_hits(cov: PairCoverage, design: Design, cases: list[CaseSpec]) -> dict[str, set[tuple[int, str]]]:
    """Count the pairs of every case the design expresses; return, per format, the (world size,
    scenario)s its configured cases ran at."""
    ran: dict[str, set[tuple[int, str]]] = defaultdict(set)
    for spec in cases:
        labels = case_labels(design, spec)
        if labels is None:
            continue
        for pair in pairs_of(labels):
            cov.hits[(design.name, spec.fmt, pair)] += 1
        if not spec.config.is_default:
            ran[spec.fmt].add((spec.world_size, spec.scenario))
    return ran


# ------------------------------------------------------------------ reports


def _name(label) -> str:
    """How a label reads: the token or regime itself, `ws4`, `mp=default` for a component's default."""
    dimension, value = label
    if value == "":
        return f"{dimension}=default"
    return f"ws{value}" if dimension == "ws" else str(value)


def _cell(cov: PairCoverage, key: Key) -> str:
    if cov.hits[key]:
        return str(cov.hits[key])
    if key in cov.promised:
        return "MISSING"
    return "-" if key in cov.impossible else "·"


def markdown(cov: PairCoverage) -> str:
    """Per design and format: the (configuration token x regime) table, the other two-way
    combinations counted per pair of dimensions, and every impossible pair with why."""
    out = [f"# configuration pairs: {len(cov.promised) - len(cov.missing)}/{len(cov.promised)} promised pairs hit, "
           f"{len(cov.missing)} missing", "",
           "Regimes: " + "; ".join(f"`{r}` {DESCRIPTIONS[r]}" for r in REGIMES) + ".", ""]
    for design in cov.designs:
        for fmt in sorted({k[1] for k in (*cov.hits, *cov.impossible) if k[0] == design.name}):
            if not any(k[:2] == (design.name, fmt) for k in (*cov.promised, *cov.impossible)):
                continue  # no configured case of the design: its pairs are FSDP2's defaults only
            out += _format_section(cov, design, fmt)
    return "\n".join(out)


def _format_section(cov: PairCoverage, design: Design, fmt: str) -> list[str]:
    keys = [k for k in (*cov.hits, *cov.promised, *cov.impossible) if k[:2] == (design.name, fmt)]
    promised = [k for k in cov.promised if k[:2] == (design.name, fmt)]
    hit = sum(1 for k in promised if cov.hits[k])
    head = f"## {design.name} design, {fmt}: {hit}/{len(promised)} promised pairs hit"
    out = [head + (f" (not promised: {cov.not_promised[(design.name, fmt)]})"
                   if (design.name, fmt) in cov.not_promised else ""), ""]
    out += ["| token | " + " | ".join(REGIMES) + " |", "| --- | " + " | ".join("---:" for _ in REGIMES) + " |"]
    for component in design.components:
        for value in component.values:
            token = (component.name, value)
            cells = [_cell(cov, (design.name, fmt, _ordered(token, (REGIME, r)))) for r in REGIMES]
            out.append(f"| {_name(token)} | " + " | ".join(cells) + " |")
    out += ["", "Other two-way combinations (pairs hit / promised):", ""]
    dims = design.dimensions
    for i, a in enumerate(dims):
        for b in dims[i + 1:]:
            if {a, b} & {REGIME} and {a, b} & {c.name for c in design.components}:
                continue  # the table above
            group = [k for k in keys if {k[2][0][0], k[2][1][0]} == {a, b}]
            wanted = [k for k in group if k in cov.promised]
            missing = [k for k in wanted if not cov.hits[k]]
            line = f"- {a} x {b}: {len(wanted) - len(missing)}/{len(wanted)}"
            if missing:
                line += ", MISSING " + ", ".join(f"({_name(k[2][0])}, {_name(k[2][1])})" for k in missing)
            out.append(line)
    impossible = sorted((k for k in keys if k in cov.impossible), key=repr)
    never = _regimes_never(design, impossible)
    if never:
        out += ["", f"Regimes {fmt} cannot produce here: " + "; ".join(
            f"{r} ({cov.impossible[k]})" for r, k in never.items()) + "."]
    impossible = [k for k in impossible if not {(REGIME, r) for r in never} & set(k[2])]
    if impossible:
        out += ["", "Pairs that cannot occur:", ""]
        out += [f"- ({_name(k[2][0])}, {_name(k[2][1])}): {cov.impossible[k]}" for k in impossible]
    return out + [""]


def _regimes_never(design: Design, impossible: list[Key]) -> dict[str, Key]:
    """The regimes no case of the design can hit (every pair with them is impossible), each with one
    of its pairs (whose reason says why)."""
    partners = {(d, v) for d in design.dimensions if d != REGIME for v in design.values(d)}
    by_regime: dict[str, list[Key]] = defaultdict(list)
    for key in impossible:
        for dimension, value in key[2]:
            if dimension == REGIME:
                by_regime[value].append(key)
    return {r: keys[0] for r, keys in by_regime.items()
            if {(k[2][0] if k[2][1] == (REGIME, r) else k[2][1]) for k in keys} >= partners}


def _ordered(a, b) -> Pair:
    return (a, b) if repr(a) <= repr(b) else (b, a)


def promise_lines(cov: PairCoverage, limit: int = 10) -> list[str]:
    """One line when every promised pair is hit (none when none is promised), else the missing ones."""
    if not cov.promised:
        return []
    hit = len(cov.promised) - len(cov.missing)
    head = f"coverage: {hit}/{len(cov.promised)} promised configuration pairs hit"
    if not cov.missing:
        return [head]
    lines = [f"{head}, {len(cov.missing)} MISSING (`qgather coverage` lists the pairs)"]
    for design, fmt, (a, b) in cov.missing[:limit]:
        lines.append(f"  MISSING {fmt} ({_name(a)}, {_name(b)}) in the {design} design")
    if len(cov.missing) > limit:
        lines.append(f"  ... and {len(cov.missing) - limit} more")
    return lines
