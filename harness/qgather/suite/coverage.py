"""The coverage matrix of a run: format x buffer x regime x scenario x configuration (x world size),
which cells its cases hit and which promised cells they miss; and the configuration pairs of the
configuration designs (qgather.suite.config_coverage: configuration token x shape regime per format,
and the other two-way combinations).

A cell is promised for every (format, world size, scenario) the run has cases of under a sweep's
first FSDP2 configuration: each regime of qgather.suite.shape_space's space at that world size. Cells
of other configurations are shown when hit (the configuration designs promise pairs instead). A
`layers` or `block` case hits the cells of every weight of its module (qgather.model.layers) and
promises none: its sweep picks a few module shapes, not the shape space.

`qgather coverage [--impl ..] [--formats ..] [--world-sizes ..] [--scenarios ..] [--exhaustive]`
(qgather.cli.coverage) prints the matrix and the pairs of the suite's selection as Markdown (exit 1 if
a promised cell or pair is missing); the pytest plugin prints its broken promises (`promise_lines`) at
the end of a session and writes both of the cases it ran to the report directory's coverage.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from qgather.model.block import module_weights
from qgather.model.case import CaseSpec, tensor_parallel_layout
from qgather.model.layers import MODULE_SCENARIOS
from qgather.suite import config_coverage, shape_space
from qgather.suite import memo as _memo
from qgather.suite.config_coverage import PairCoverage
from qgather.suite.modules import suite_companions, suite_sweeps
from qgather.suite.selection import device_type, runnable

DEFAULT_CONFIG = "default"

Key = tuple[str, str, str, str, str, int]  # format, buffer, regime, scenario, config, world size


def config_name(spec: CaseSpec) -> str:
    return spec.config.token or DEFAULT_CONFIG


@dataclass
class Coverage:
    hits: Counter = field(default_factory=Counter)  # Key -> cases
    promised: set[Key] = field(default_factory=set)
    pairs: PairCoverage = field(default_factory=PairCoverage)

    @property
    def missing(self) -> list[Key]:
        return sorted(k for k in self.promised if not self.hits[k])

    @property
    def broken(self) -> bool:
        """Whether a promised cell or configuration pair is missing."""
        return bool(self.missing or self.pairs.missing)


def measure(cases: Iterable[CaseSpec], promised_configs: Iterable[str] = (DEFAULT_CONFIG,),
            memo: _memo.Memo | None = None) -> Coverage:
    """The cells `cases` hit, and those promised for the (format, world size, scenario, config) they run
    (`memo`: the configuration designs' pairs through it, qgather.suite.config_coverage.measure)."""
    cases = list(cases)
    cov = Coverage(pairs=config_coverage.measure(cases, memo=memo))
    primary = set(promised_configs)
    seen: set[tuple[str, int, str, str]] = set()
    for spec in cases:
        if spec.scenario == "model":  # its shape is a model's hidden x ffn, not a weight's
            continue
        config = config_name(spec)
        module = spec.scenario in MODULE_SCENARIOS
        weights = [w.spec for w in module_weights(spec)] if module else [spec]
        for buffer, regime in set().union(*(shape_space.regimes(spec.fmt, *_sharded(w)) for w in weights
                                            if w.fmt == spec.fmt)):  # a block's other format: not its cells
            cov.hits[(spec.fmt, buffer, regime, spec.scenario, config, spec.world_size)] += 1
        if not module:
            seen.add((spec.fmt, spec.world_size, spec.scenario, config))
    for fmt, ws, scenario, config in seen:
        if config in primary:
            cov.promised |= {(fmt, b, r, scenario, config, ws) for b, r in shape_space.promised(fmt, ws)}
    return cov


def _sharded(spec: CaseSpec) -> tuple[tuple[int, ...], int]:
    """(shape, ranks) of what FSDP2 shards along dim 0: under tensor parallelism one TP piece over
    the "dp" ranks, else the weight over the world."""
    tp = tensor_parallel_layout(spec)
    if tp is None:
        return tuple(spec.shape), spec.world_size
    return tp.piece_shape(), spec.config.tp[0]


def markdown(cov: Coverage) -> str:
    """One table per (scenario, configuration): rows format/buffer/regime, columns world sizes;
    a cell is the number of cases hitting it, MISSING if promised and not hit, '·' if neither."""
    keys = set(cov.hits) | cov.promised
    out = [f"# qgather coverage: {len(cov.promised) - len(cov.missing)}/{len(cov.promised)} promised cells hit, "
           f"{len(cov.missing)} missing", ""]
    for scenario, config in sorted({(k[3], k[4]) for k in keys}):
        sub = [k for k in keys if k[3] == scenario and k[4] == config]
        sizes = sorted({k[5] for k in sub})
        out += [f"## scenario {scenario}, configuration {config}", "",
                "| format | buffer | regime | " + " | ".join(f"ws{w}" for w in sizes) + " |",
                "| --- | --- | --- | " + " | ".join("---:" for _ in sizes) + " |"]
        for fmt, buf, regime in sorted({k[:3] for k in sub}):
            cells = [_cell(cov, (fmt, buf, regime, scenario, config, w)) for w in sizes]
            out.append(f"| {fmt} | {buf} | {regime} | " + " | ".join(cells) + " |")
        out.append("")
    if cov.pairs.hits and (cov.pairs.promised or cov.pairs.impossible):
        out += ["", config_coverage.markdown(cov.pairs)]
    return "\n".join(out)


def _cell(cov: Coverage, key: Key) -> str:
    if cov.hits[key]:
        return str(cov.hits[key])
    return "MISSING" if key in cov.promised else "·"


def summary_lines(cov: Coverage, limit: int = 20) -> list[str]:
    """The terminal summary: promised/hit per (scenario, configuration), then the missing cells."""
    lines = []
    groups = sorted({(k[3], k[4]) for k in set(cov.hits) | cov.promised})
    for scenario, config in groups:
        promised = [k for k in cov.promised if k[3] == scenario and k[4] == config]
        hit = len({k for k in cov.hits if k[3] == scenario and k[4] == config})
        missing = sum(1 for k in promised if not cov.hits[k])
        lines.append(f"{scenario:<8} {config:<24} {hit:>5} cells hit, {len(promised) - missing}/{len(promised)} "
                     f"promised" + (f", {missing} MISSING" if missing else ""))
    for key in cov.missing[:limit]:
        fmt, buf, regime, scenario, config, ws = key
        lines.append(f"  MISSING {fmt} {buf} {regime} at ws{ws} ({scenario}, {config})")
    return lines + config_coverage.promise_lines(cov.pairs, limit)


def promise_lines(cov: Coverage, limit: int = 10) -> list[str]:
    """The end of a session's summary: one line when every promised cell is hit, else the broken
    promises (the first `limit` missing cells)."""
    hit = len(cov.promised) - len(cov.missing)
    head = f"coverage: {hit}/{len(cov.promised)} promised cells hit"
    pairs = config_coverage.promise_lines(cov.pairs, limit)
    if not cov.missing:
        return [head, *pairs]
    lines = [f"{head}, {len(cov.missing)} MISSING (the report directory's coverage.md has the matrix)"]
    for fmt, buf, regime, scenario, config, ws in cov.missing[:limit]:
        lines.append(f"  MISSING {fmt} {buf} {regime} at ws{ws} ({scenario}, {config})")
    if len(cov.missing) > limit:
        lines.append(f"  ... and {len(cov.missing) - limit} more")
    return lines + pairs


def suite_cases(impls: list[str], formats=None, world_sizes=None, scenarios=None,
                exhaustive: bool = False, named: list[str] | None = None,
                device: str = "auto", memo: bool = False) -> tuple[list[CaseSpec], set[str]]:
    """The suite's selected cases (as `qgather run` runs them: without `exhaustive`, no sweep marked
    slow; only the implementations `named`, None for the default run, in what each declares on `device`:
    qgather.suite.selection) and the configuration tokens promised in full (each sweep's first).
    `memo`: the sweeps' cases from qgather.suite.memo where this source generated them before (the
    command line's listing and run check; a caller that patches a generator in-process computes)."""
    cases, primary = [], set()
    on = device_type(device)
    kept = _memo.Memo() if memo else None
    generate = kept.cases if kept else _generated
    for module, sweep, fixed in suite_sweeps():
        if not exhaustive and "slow" in getattr(sweep, "marks", ()):
            continue
        generated = generate(module, sweep, fixed or impls, formats=formats, world_sizes=world_sizes,
                             scenarios=scenarios, exhaustive=exhaustive)
        cases += runnable(generated, fixed or named, on)
        configs = getattr(sweep, "configs", None)  # sweeps built on the shape space promise its regimes
        if configs:
            primary.add(configs[0].token or DEFAULT_CONFIG)
    for module, sweep, own in () if named else suite_companions():
        generated = generate(f"{module} (companions)", sweep, own, formats=formats, world_sizes=world_sizes,
                             scenarios=scenarios)
        cases += runnable(generated, None, on)
    if kept:
        kept.flush()
    return cases, primary


def _generated(_module: str, sweep, impls, **selection) -> list[CaseSpec]:
    return list(sweep.cases(list(impls), **selection))
