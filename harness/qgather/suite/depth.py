"""The depth of a selection's cells: how many cases hold each (family, format) cell, over how many
shape classes and world sizes; what the default run promises of each; and the crosses of the module
scenarios and torch.compile with the configuration families.

A *family* is a scenario (gather, steps, reshard, hooks, virtual, block, layers) or a configuration
family (mp: a mixed-precision policy; raf: a reshard_after_forward other than True; hsdp; dim1;
dcp: a checkpoint resharded; compile). A case belongs to its scenario's family and to the family of
every configuration token it carries, so `reference:fp8_block:...:block:s0:mp-bf16` deepens both
(block, fp8_block) and (mp, fp8_block).

A case's *shape classes* are its weight's regimes where FSDP2 splits it (qgather.suite.config_regimes,
under its configuration: the shard mesh of an HSDP mesh, K under dim1, both world sizes of a
checkpoint), reduced to four: aligned, misaligned (a shard starts inside a scale block: `split`),
uneven, zero-row. A module scenario's case is classed by its first weight (its id's shape).

Promised (`promised`), for every cell the selection has cases of: at least MIN_CASES cases, at
least MIN_WORLD_SIZES world sizes, and at least MIN_CLASSES shape classes, or as many as the family
can reach on the format (`reachable`: a per-tensor format has no block to misalign; dim1 splits K,
which FSDP2 shards evenly). Not promised: tp (its own design: format x mesh x scenario,
qgather.suite.tp_sweep), model (a library's model, not a weight) and nested (a variant of block).
The crosses (`CROSSES`): block, layers and compile each with mp, raf, hsdp and dcp, at least one
case per format; the block and layers scenarios load no checkpoint (qgather.scenarios.block,
qgather.scenarios.layers), so those two crosses with dcp are listed as not runnable, never as met.

`qgather coverage` prints the depth table and its minimum, and exits 1 when a promised cell or cross
falls short (qgather.cli.coverage).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache

from qgather.model.case import CaseSpec
from qgather.suite.config_regimes import block_units, case_regimes

MIN_CASES = 10
MIN_CLASSES = 3
MIN_WORLD_SIZES = 2

SCENARIO_FAMILIES = ("gather", "steps", "reshard", "hooks", "virtual", "block", "layers")
CONFIG_FAMILIES = ("mp", "raf", "hsdp", "dim1", "dcp", "compile")
UNPROMISED = frozenset({"tp", "model", "nested"})
CLASSES = ("aligned", "misaligned", "uneven", "zero-row")
_CLASS_OF = {"aligned": "aligned", "split": "misaligned", "uneven": "uneven", "zero-row": "zero-row"}

#: (family, configuration family) pairs each format must hold in one case at least
CROSSES: tuple[tuple[str, str], ...] = tuple((a, b) for a in ("block", "layers", "compile")
                                             for b in ("mp", "raf", "hsdp", "dcp"))
#: crosses no case can hold, and why
NOT_RUNNABLE: dict[tuple[str, str], str] = {
    ("block", "dcp"): "the block scenario loads no checkpoint (qgather.scenarios.block)",
    ("layers", "dcp"): "the layers scenario loads no checkpoint (qgather.scenarios.layers)",
}


def families(spec: CaseSpec) -> frozenset[str]:
    """The families a case belongs to: its scenario and each of its configuration's."""
    config = spec.config
    held = {spec.scenario}
    for name, present in (("mp", config.param_dtype is not None), ("raf", config.reshard_after_forward is not True),
                          ("hsdp", config.hsdp is not None), ("tp", config.tp is not None),
                          ("dim1", config.shard_dim == 1), ("compile", config.compile),
                          ("dcp", config.saved_at_world_size is not None), ("nested", config.nested)):
        if present:
            held.add(name)
    return frozenset(held)


def shape_classes(spec: CaseSpec) -> frozenset[str]:
    """The case's shape classes (aligned, misaligned, uneven, zero-row) where FSDP2 splits its weight;
    none for a TP case (a piece over the dp ranks: its own design's regimes) or a model's."""
    if spec.config.tp is not None or spec.scenario == "model":
        return frozenset()
    return frozenset(_CLASS_OF[r] for r in case_regimes(spec) if r in _CLASS_OF)


@cache
def reachable(family: str, fmt: str) -> int:
    """How many shape classes a family can reach on a format: no misaligned class without a block
    along the sharded dimension (rows; K under dim1), and under dim1 no uneven or zero-row shard
    (FSDP2 shards K evenly or not at all)."""
    axis = "cols" if family == "dim1" else "rows"
    blocks = any(u > 1 for u in block_units(fmt, axis))
    if family == "dim1":
        return 1 + blocks
    return 3 + blocks


@dataclass
class Cell:
    """What the cases of one (family, format) cell hold."""

    cases: int = 0
    classes: set[str] = field(default_factory=set)
    world_sizes: set[int] = field(default_factory=set)

    def shortfalls(self, family: str, fmt: str) -> list[str]:
        """What the cell lacks of its promise (nothing when it holds it)."""
        want = min(MIN_CLASSES, reachable(family, fmt))
        out = []
        if self.cases < MIN_CASES:
            out.append(f"{self.cases} cases < {MIN_CASES}")
        if len(self.classes) < want:
            out.append(f"{len(self.classes)} shape classes < {want}")
        if len(self.world_sizes) < MIN_WORLD_SIZES:
            out.append(f"{len(self.world_sizes)} world sizes < {MIN_WORLD_SIZES}")
        return out


@dataclass
class Depth:
    """The cells of a selection, and the crosses its formats hold."""

    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)  # (family, format) -> Cell
    crosses: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (family, config family, format)
    promised: bool = True  # False: a narrowed selection (world sizes) shows its depth, promises none

    @property
    def formats(self) -> list[str]:
        return sorted({fmt for _, fmt in self.cells})

    def short_cells(self) -> list[tuple[str, str, list[str]]]:
        """(family, format, shortfalls) of every promised cell under its promise."""
        if not self.promised:
            return []
        out = []
        for (family, fmt), cell in sorted(self.cells.items()):
            if family in UNPROMISED:
                continue
            lacks = cell.shortfalls(family, fmt)
            if lacks:
                out.append((family, fmt, lacks))
        return out

    def missing_crosses(self) -> list[tuple[str, str, str]]:
        """(family, configuration family, format) of every runnable cross a format of the selection
        has cases of the family for, and no case of both."""
        if not self.promised:
            return []
        return [(a, b, fmt) for fmt in self.formats for a, b in CROSSES
                if (a, b) not in NOT_RUNNABLE and (a, fmt) in self.cells and (b, fmt) in self.cells
                and not self.crosses.get((a, b, fmt))]

    @property
    def broken(self) -> bool:
        return bool(self.short_cells() or self.missing_crosses())

    def minimum(self) -> tuple[int, str, str] | None:
        """(cases, family, format) of the promised cell with the fewest cases."""
        cells = [(c.cases, family, fmt) for (family, fmt), c in self.cells.items() if family not in UNPROMISED]
        return min(cells) if cells else None


def measure(cases: Iterable[CaseSpec], promised: bool = True) -> Depth:
    """The depth of `cases`' cells (`promised`: whether the selection promises depth at all)."""
    depth = Depth(promised=promised)
    for spec in cases:
        held = families(spec)
        classes = shape_classes(spec)
        for family in held:
            cell = depth.cells.setdefault((family, spec.fmt), Cell())
            cell.cases += 1
            cell.classes |= classes
            cell.world_sizes.add(spec.world_size)
        for a, b in CROSSES:
            if a in held and b in held:
                key = (a, b, spec.fmt)
                depth.crosses[key] = depth.crosses.get(key, 0) + 1
    return depth


def markdown(depth: Depth) -> str:
    """The depth table (family x format: cases / shape classes / world sizes), its minimum, the
    crosses, and every shortfall."""
    fmts = depth.formats
    order = [f for f in (*SCENARIO_FAMILIES, *CONFIG_FAMILIES, *sorted(UNPROMISED))
             if any((f, fmt) in depth.cells for fmt in fmts)]
    lowest = depth.minimum()
    head = "# qgather depth: cases / shape classes / world sizes per (family, format)"
    out = [head, "",
           f"Promised per cell: >= {MIN_CASES} cases, >= {MIN_WORLD_SIZES} world sizes, >= {MIN_CLASSES} shape "
           "classes (aligned, misaligned, uneven, zero-row) or all the family reaches on the format"
           + ("" if depth.promised else " (not promised: the selection narrows the world sizes)") + ".", ""]
    if lowest:
        out += [f"minimum depth: {lowest[0]} cases ({lowest[1]}, {lowest[2]})", ""]
    out += ["| family | " + " | ".join(fmts) + " |", "| --- | " + " | ".join("---:" for _ in fmts) + " |"]
    for family in order:
        row = []
        for fmt in fmts:
            cell = depth.cells.get((family, fmt))
            row.append(f"{cell.cases}/{len(cell.classes)}/{len(cell.world_sizes)}" if cell else "·")
        out.append(f"| {family}{' (not promised)' if family in UNPROMISED else ''} | " + " | ".join(row) + " |")
    out += ["", "## crosses: cases holding both, per format", "",
            "| cross | " + " | ".join(fmts) + " |", "| --- | " + " | ".join("---:" for _ in fmts) + " |"]
    for a, b in CROSSES:
        why = NOT_RUNNABLE.get((a, b))
        cells = ["n/a" if why else str(depth.crosses.get((a, b, fmt), 0)) for fmt in fmts]
        out.append(f"| {a} x {b} | " + " | ".join(cells) + " |" + (f" {why}" if why else ""))
    short, crosses = depth.short_cells(), depth.missing_crosses()
    if short or crosses:
        out += ["", "## under the promise", ""]
        out += [f"- SHALLOW {family} x {fmt}: {', '.join(lacks)}" for family, fmt, lacks in short]
        out += [f"- MISSING cross {a} x {b} on {fmt}" for a, b, fmt in crosses]
    return "\n".join(out) + "\n"
