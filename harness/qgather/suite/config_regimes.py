"""The shape regimes of a case under its FSDP2 configuration: what the configuration sweeps cross
with every configuration token (qgather.suite.config_space, qgather.suite.config_sweep).

A regime is one property of how the case's weight is split, judged where FSDP2 splits it: over the
shard mesh (S ranks of an HSDP mesh, not the world), along K under `dim1`, and for a checkpoint
saved at world size A (`dcp-wsA`) both where it was saved and where it is loaded:

  aligned       every rank holds an equal, non-empty shard starting on the format's block
  uneven        the last non-empty shard is shorter than the others (it travels padded)
  zero-row      some rank holds nothing
  m<ws          the sharded dimension is smaller than the ranks it is split over
  3d            a 3-D expert weight
  split         a shard starts inside one of the format's scale blocks (or tiles): the verdict policy's
                misalignment (qgather.model.layout), where a rejection is acceptable
  tail-partial  the last block along the sharded dimension is partial

These are coarser than qgather.suite.shape_space's per-buffer cells (which the shape sweeps promise at
each world size under FSDP2's defaults) and are computed with the same layout classes the golden and
the verdict policy use (qgather.model.case.shard_layout, qgather.model.layout.alignment_problem), so a
configuration that changes the layout (a later tensor-parallel token included) changes them there.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache

from qgather.model.case import CaseSpec, ColumnShardLayout, shard_layout
from qgather.model.layout import alignment_problem
from qgather.suite.shape_space import buffer_facts

REGIMES: tuple[str, ...] = ("aligned", "uneven", "zero-row", "m<ws", "3d", "split", "tail-partial")

DESCRIPTIONS: dict[str, str] = {
    "aligned": "every rank holds an equal, non-empty shard starting on the format's block",
    "uneven": "the last non-empty shard is shorter than the others (padded on the wire)",
    "zero-row": "some rank holds nothing",
    "m<ws": "the sharded dimension is smaller than the ranks it is split over",
    "3d": "a 3-D expert weight",
    "split": "a shard starts inside a scale block or tile",
    "tail-partial": "the last block along the sharded dimension is partial",
}

#: the regimes that say a shard is not a clean, equal piece: "aligned" is their absence
_IRREGULAR = frozenset({"uneven", "zero-row", "m<ws", "split"})


def placements(spec: CaseSpec) -> tuple[CaseSpec, ...]:
    """The case as its weight is sharded at each world size it is split at: itself, and for a
    checkpoint saved at world size A the same configuration at A (where the save shards it). Each
    without the checkpoint, which does not change how that world size splits the weight."""
    saved = spec.config.saved_at_world_size
    if saved is None:
        return (spec,)
    config = replace(spec.config, saved_at_world_size=None, saved_after_forward=False)
    return replace(spec, config=config), replace(spec, world_size=saved, config=config)


def case_regimes(spec: CaseSpec) -> frozenset[str]:
    """The regimes the case hits (see the module docstring)."""
    return combined(spec.shape, [placement_regimes(placed) for placed in placements(spec)])


def combined(shape: tuple[int, ...], placed: list[frozenset[str]]) -> frozenset[str]:
    """The regimes of a shape from those of each placement of it (`placement_regimes`)."""
    out = set().union(*placed)
    if len(shape) == 3:
        out.add("3d")
    if not out & _IRREGULAR:
        out.add("aligned")
    return frozenset(out)


@cache
def placement_regimes(spec: CaseSpec) -> frozenset[str]:
    """The regimes of one placement (a case without a checkpoint) that depend on how it is split."""
    layout = shard_layout(spec)
    out = set()
    if isinstance(layout, ColumnShardLayout):
        extent, size, axis = layout.cols, layout.world_size, "cols"
    else:
        extent, size, axis = layout.dim0, layout.world_size, "rows"
    chunk = math.ceil(extent / size)
    held = math.ceil(extent / chunk)
    if held < size:
        out.add("zero-row")
    if extent - (held - 1) * chunk < chunk:
        out.add("uneven")
    if extent < size:
        out.add("m<ws")
    if alignment_problem(spec):
        out.add("split")
    if _tail_partial(spec.fmt, tuple(spec.shape), axis):
        out.add("tail-partial")
    return frozenset(out)


def _tail_partial(fmt: str, shape: tuple[int, ...], axis: str) -> bool:
    """Whether the last entry of some buffer along `axis` (rows: M = prod(shape[:-1]); cols: K) is partial."""
    extent = math.prod(shape[:-1]) if axis == "rows" else shape[-1]
    return any(u > 1 and extent % u for u in block_units(fmt, axis))


@cache
def block_units(fmt: str, axis: str) -> tuple[int, ...]:
    """The units (elements per buffer entry) of the format's buffers along `axis` ("rows" or "cols")."""
    units = {getattr(b, axis).unit for b in buffer_facts(fmt) if getattr(b, axis) is not None}
    return tuple(sorted(units))
