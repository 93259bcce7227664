"""The tensor parallel + FSDP2 sweeps (`tp-DxT`, `tp-DxT-row`: qgather.model.config).

- `TensorParallelSweep` (cases/test_tensor_parallel.py): implementation x format x mesh x scenario x
  dtype as a covering design (every pair of values in at least one case) for the default run, the
  full product with --exhaustive (slow); then checkpoints saved at one dp size and loaded at another
  (the same TP split), every format at least once. Shapes are chosen per mesh so that every TP piece
  and every dp shard of it starts on the format's blocks: these cases pass only as EXACT.
- `TensorParallelAlignment` (part of the alignment sweep, cases/test_alignment.py): TP x DP splits
  that cut the format's blocks (a TP piece off the row or column block, a dp shard of a piece off
  the row block), at tp-2x2 and tp-2x2-row: EXACT or REJECTED, never silent.
- `TensorParallelVirtual` (part of the virtual sweep, cases/test_virtual.py): dp x tp worlds of up to
  1024 ranks (tp-32x8, tp-128x8, tp-8x8-row), emulated in one process.

Beside the default implementation (reference) the default run also has torchao with precomputed
scales (`torchao:precompute`, fp8_tensor), which reduces its amax over both mesh dimensions. Plain
`torchao` scales each TP piece by its own amax (docs/findings.md): it runs where --impl names it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from qgather.formats import FORMATS
from qgather.model.case import DTYPES, CaseSpec
from qgather.model.config import FsdpConfig
from qgather.model.layout import column_block
from qgather.suite.covering import pairwise
from qgather.suite.sweeps import SuiteSweep, narrow

MESHES = ("tp-2x2", "tp-2x2-row", "tp-1x2", "tp-2x1", "tp-2x4", "tp-4x2-row")
SCENARIOS = ("gather", "steps", "reshard")
#: checkpoints saved at one dp size and loaded at another, the tp size and style unchanged
#: (dcp-wsA under tp-DxT: saved at tp-(A/T)xT; -trained: after a training forward there)
CHECKPOINTS = ("tp-4x2+dcp-ws4", "tp-2x2+dcp-ws8", "tp-1x2-row+dcp-ws4-trained", "tp-2x2-row+dcp-ws2")
#: implementations that hold only some formats
IMPL_FORMATS = {"torchao": ("fp8_tensor",), "torchao:precompute": ("fp8_tensor",)}
K = 64


def _units(fmt: str) -> tuple[int, int]:
    """(rows, columns) a piece or a shard must be a multiple of to start on the format's blocks (at
    least 16, so that per-tensor shapes are ones GPU GEMMs accept too)."""
    return max(FORMATS[fmt].row_block, 16), max(column_block(fmt), 16)


def aligned_shape(fmt: str, config: FsdpConfig) -> tuple[int, int]:
    """A weight whose TP pieces and their dp shards all start on the format's blocks: 8 row units
    (dp x tp <= 8 for colwise, dp <= 8 for rowwise), K a multiple of T column units (rowwise)."""
    rows, cols = _units(fmt)
    k = max(K, config.tp[1] * cols) if config.tp_style == "row" else K
    return 8 * rows, k


def world_size(config: FsdpConfig) -> int:
    return config.tp[0] * config.tp[1]


def _impl_formats(impls: Iterable[str], also: Sequence[str]) -> list[str]:
    impls = list(impls)
    if impls == ["reference"]:
        impls += list(also)
    return [f"{i}|{f}" for i in impls for f in IMPL_FORMATS.get(i, FORMATS)]


@dataclass(frozen=True)
class TensorParallelSweep(SuiteSweep):
    """tp-DxT cases of aligned shapes: a covering design of implementation|format x mesh x scenario x
    dtype (the full product with `exhaustive`), then the checkpoint cases. Like ConfigSweep, the
    design is made over every value and then narrowed, so a narrowed run's ids are a subset."""

    marks: Sequence[str] = field(default_factory=tuple)
    #: beside the plugin's default implementation (reference), these run too
    also_with_default: Sequence[str] = ("torchao:precompute",)

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({world_size(FsdpConfig.parse(m)) for m in (*MESHES, *CHECKPOINTS)}))

    @property
    def scenarios(self) -> tuple[str, ...]:
        return SCENARIOS

    def cases(self, impls: Iterable[str], formats: Iterable[str] | None = None,
              world_sizes: Iterable[int] | None = None, scenarios: Iterable[str] | None = None,
              exhaustive: bool = False) -> list[CaseSpec]:
        impl_fmts = _impl_formats(impls, self.also_with_default)
        factors = (impl_fmts, MESHES, SCENARIOS, DTYPES)
        rows = list(itertools.product(*factors) if exhaustive else pairwise(factors))
        # every implementation|format once per checkpoint pair, cycling: each pair for several formats
        rows += [(impl_fmt, CHECKPOINTS[i % len(CHECKPOINTS)], "gather", "bf16")
                 for i, impl_fmt in enumerate(impl_fmts)]
        cases = [_case(*row) for row in rows]
        keep_fmts, keep_scens = set(narrow(FORMATS, formats)), set(narrow(SCENARIOS, scenarios))
        keep_sizes = None if world_sizes is None else set(world_sizes)
        return [c for c in cases if c.fmt in keep_fmts and c.scenario in keep_scens
                and (keep_sizes is None or c.world_size in keep_sizes)]


def _case(impl_fmt: str, mesh: str, scenario: str, dtype: str) -> CaseSpec:
    impl, fmt = impl_fmt.split("|")
    config = FsdpConfig.parse(mesh)
    return CaseSpec(impl, fmt, aligned_shape(fmt, config), dtype, world_size(config), scenario, 0, config)


#: the alignment sweep's TP x DP splits, at 4 ranks: kind -> (configuration, shape(fmt))
def _misaligned_shapes(fmt: str) -> dict[str, tuple[str, tuple[int, int]]]:
    rows, cols = _units(fmt)
    per_tensor = FORMATS[fmt].row_block == 1
    return {
        # colwise: each TP piece 1.5 row units (per-tensor: 23-row pieces, dp shards of 12 and 11 rows)
        "tp-split": ("tp-2x2", (3 * rows - 2 if per_tensor else 3 * rows, K)),
        # colwise: pieces of one row unit, dp shards of half of one
        "dp-split": ("tp-2x2", (2 * rows, K)),
        # rowwise: each TP piece half a column block
        "tp-split-row": ("tp-2x2-row", (8 * rows, cols)),
        # rowwise: dp shards of half a row unit
        "dp-split-row": ("tp-2x2-row", (rows, 2 * cols)),
    }


@dataclass(frozen=True)
class TensorParallelAlignment(SuiteSweep):
    """The alignment sweep's tensor-parallel part: every format's misaligned TP x DP splits at 4 ranks
    (gather, bf16). The reference must refuse them (REJECTED, naming the block) or gather them
    exactly; per-tensor formats have no blocks to cut and get uneven dp shards of a TP piece instead."""

    marks: Sequence[str] = field(default_factory=tuple)
    world_sizes: Sequence[int] = (4,)
    scenarios: Sequence[str] = ("gather",)

    def cases(self, impls: Iterable[str], formats: Iterable[str] | None = None,
              world_sizes: Iterable[int] | None = None, scenarios: Iterable[str] | None = None,
              exhaustive: bool = False) -> list[CaseSpec]:
        if not set(narrow(self.world_sizes, world_sizes)) or not narrow(self.scenarios, scenarios):
            return []
        out = []
        for impl in impls:
            for fmt in narrow(FORMATS, formats):
                for token, shape in _misaligned_shapes(fmt).values():
                    out.append(CaseSpec(impl, fmt, shape, "bf16", 4, "gather", 0, FsdpConfig.parse(token)))
        return out


#: the virtual sweep's dp x tp worlds: (configuration, in the default run for every format)
VIRTUAL_MESHES = (("tp-32x8", True), ("tp-8x8-row", True), ("tp-128x8", False), ("tp-128x8-row", False))
#: formats whose 1024-rank worlds run in the default run (the others: --exhaustive)
VIRTUAL_LARGE_FORMATS = ("fp8_tensor", "nvfp4_2d")


def virtual_shape(fmt: str, config: FsdpConfig) -> tuple[int, int]:
    """Aligned for dp x tp ranks: one row unit per dp shard of a piece, T column units (rowwise)."""
    rows, cols = _units(fmt)
    dp, tp = config.tp
    if config.tp_style == "row":
        return dp * rows, max(K, tp * cols)
    return dp * tp * rows, K


@dataclass(frozen=True)
class TensorParallelVirtual(SuiteSweep):
    """dp x tp worlds of 64 to 1024 ranks in the virtual scenario, one aligned shape per format and
    mesh; the 1024-rank meshes for VIRTUAL_LARGE_FORMATS by default, for every format exhaustively."""

    marks: Sequence[str] = field(default_factory=tuple)
    scenarios: Sequence[str] = ("virtual",)

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({world_size(FsdpConfig.parse(m)) for m, _ in VIRTUAL_MESHES}))

    def cases(self, impls: Iterable[str], formats: Iterable[str] | None = None,
              world_sizes: Iterable[int] | None = None, scenarios: Iterable[str] | None = None,
              exhaustive: bool = False) -> list[CaseSpec]:
        if not narrow(self.scenarios, scenarios):
            return []
        out = []
        for impl in impls:
            for fmt in narrow(FORMATS, formats):
                for token, default in VIRTUAL_MESHES:
                    config = FsdpConfig.parse(token)
                    ws = world_size(config)
                    if (world_sizes is not None and ws not in set(world_sizes)) or not (
                            default or exhaustive or fmt in VIRTUAL_LARGE_FORMATS):
                        continue
                    out.append(CaseSpec(impl, fmt, virtual_shape(fmt, config), "bf16", ws, "virtual", 0, config))
        return out
