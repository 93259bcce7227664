"""Modules of several quantized weights (the layers scenario: qgather.scenarios.layers), at 1, 2, 3
and 4 ranks for every format. A case's shape is its module's first weight (qgather.model.layers adds
an aligned weight and a 3-D expert weight): S u - 1 rows (u the format's row unit, S the shard
ranks), shards aligned and the last one row short; and, for the formats with row blocks, S u + u/2
rows, whose shards split a block: the reference refuses that weight, so the case is REJECTED after
the module's other two weights were judged EXACT; a first weight some rank holds no rows of, and
at 2 and 4 ranks an aligned one (FirstWeights), so that every format holds at least 10 cases over
three shape classes (qgather.suite.depth). Under `compile` (three formats at 2 ranks) the module's
forward is compiled; under `raf-no`, `mp-bf16` and `hsdp-2x2` (every format) its layers keep their
weights from the forward to the backward's unshard, gather in bf16 from fp32 masters, or shard over
one dimension of a 2 x 2 mesh. torchao (float8 per tensor; its own set unless
--impl names the implementations) runs even first weights at 1, 2 and 4 ranks, with and without
precomputed scales: uneven shards are a known torchao failure on gloo (docs/findings.md).
"""

from __future__ import annotations

import functools

import pytest

from qgather.model.config import FsdpConfig
from qgather.model.layers import row_unit
from qgather.suite import shape_space
from qgather.suite.sweeps import CaseSet, K, Sweep

WORLD_SIZES = (1, 2, 3, 4)
COMPILE = FsdpConfig(compile=True)
RAF_NO = FsdpConfig(reshard_after_forward=False)
TORCHAO_IMPLS = ("torchao", "torchao:precompute")
#: one per-tensor, one blockwise and one columnwise-transposed format: a compiled forward costs ~2 s on CI
COMPILE_FORMATS = ("fp8_tensor", "fp8_block", "nvfp4_1d")


class FirstWeights:
    """The first weight of each module, per (format, world size), picked by its regimes at that world
    size (qgather.suite.shape_space; 2-D, K = 64, u to 4 S u rows, the fewest rows first): one whose
    shards are uneven but aligned, and (`split`) one whose shards split a scale block; where the
    format has neither (one rank; or no uneven split that keeps the blocks whole), an aligned one with
    a partial last block, else S u rows. `zero_row` adds, where the world size has more than one rank,
    one some rank of which holds no rows (1 to 4 S u rows: blocks split or not, whichever comes first)
    (else the fewest uneven rows not picked yet); `aligned_at` adds, at those world sizes, 2 S u rows:
    even shards on whole blocks."""

    def __init__(self, split: bool = True, zero_row: bool = False, aligned_at: tuple[int, ...] = ()) -> None:
        self.split, self.zero_row, self.aligned_at = split, zero_row, aligned_at

    def __call__(self, fmt: str) -> list[tuple[int, ...]]:
        return sorted({s for ws in WORLD_SIZES for s in self.at(fmt, ws)})

    def at(self, fmt: str, world_size: int) -> list[tuple[int, ...]]:
        picks = list(_first_weights(fmt, world_size, self.split))
        if self.zero_row and world_size > 1:
            picks += _zero_row_first(fmt, world_size)
        if world_size in self.aligned_at:
            picks.append((2 * world_size * row_unit(fmt), K))
        return list(dict.fromkeys(picks))


@functools.cache
def _first_weights(fmt: str, world_size: int, split: bool) -> tuple[tuple[int, ...], ...]:
    u = row_unit(fmt)
    pool = [(rows, K) for rows in range(u, 4 * world_size * u + 1)]
    regimes = {s: {r for _, r in shape_space.regimes(fmt, s, world_size)} for s in pool}
    holdable = [s for s in pool if "unholdable" not in regimes[s]]
    uneven = [s for s in holdable if "uneven" in regimes[s] and not regimes[s] & {"rows:split", "zero-row"}]
    splits = [s for s in holdable if "rows:split" in regimes[s]] if split else []
    picks = uneven[:1] + splits[:1]
    if not picks:
        aligned = [s for s in holdable if "rows:split" not in regimes[s]]
        picks = [s for s in aligned if "rows:tail-partial" in regimes[s]][:1] or [(world_size * u, K)]
    return tuple(picks)


@functools.cache
def _zero_row_first(fmt: str, world_size: int) -> tuple[tuple[int, ...], ...]:
    """The fewest rows some rank of which holds none; where the format's row multiple rules that out
    (mxfp8's 32 rows at 2 to 4 ranks), the fewest uneven rows not already a pick of `_first_weights`."""
    pool = [(rows, K) for rows in range(1, 4 * world_size * row_unit(fmt) + 1)]
    regimes = {s: {r for _, r in shape_space.regimes(fmt, s, world_size)} for s in pool}
    holdable = [s for s in pool if "unholdable" not in regimes[s]]
    taken = set(_first_weights(fmt, world_size, True))
    zero = [s for s in holdable if "zero-row" in regimes[s]]
    uneven = [s for s in holdable if "uneven" in regimes[s] and s not in taken]
    return tuple((zero or uneven)[:1])


def even_first(fmt: str) -> list[tuple[int, ...]]:
    """An even first weight at 1, 2 and 4 ranks (8 row units)."""
    return [(8 * row_unit(fmt), K)]


#: the configurations the layers module runs on every format, each at the world size it needs
CONFIGS = (
    (RAF_NO, "fp32", 2),
    (FsdpConfig(param_dtype="bf16"), "fp32", 2),
    (FsdpConfig(hsdp=(2, 2)), "bf16", 4),
)

SWEEP = CaseSet([
    Sweep(scenarios=("layers",), dtypes=("bf16",), world_sizes=WORLD_SIZES,
          shapes=FirstWeights(zero_row=True, aligned_at=(2, 4))),
    *(Sweep(scenarios=("layers",), dtypes=(dtype,), world_sizes=(ws,), shapes=FirstWeights(split=False),
            configs=(config,)) for config, dtype, ws in CONFIGS),
    Sweep(scenarios=("layers",), dtypes=("bf16",), world_sizes=(2,), shapes=FirstWeights(split=False),
          formats=COMPILE_FORMATS, configs=(COMPILE,)),
])

TORCHAO = CaseSet([
    Sweep(scenarios=("layers",), dtypes=("bf16",), world_sizes=(1, 2, 4), shapes=even_first, formats=("fp8_tensor",)),
    Sweep(scenarios=("layers",), dtypes=("bf16",), world_sizes=(2,), shapes=even_first, formats=("fp8_tensor",),
          configs=(COMPILE,)),
])

#: torchao's own set, run beside the default run's cases (no --impl): `qgather list --cases` lists it too
COMPANIONS = (TORCHAO, TORCHAO_IMPLS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`torchao_case`: torchao's own set, when --impl does not name the implementations."""
    # deferred: `qgather list --cases` imports this module for its SWEEP alone, without the plugin
    from qgather.pytest_plugin.collection import parametrize_companion

    if "torchao_case" in metafunc.fixturenames:
        parametrize_companion(metafunc, "torchao_case", TORCHAO, TORCHAO_IMPLS)


def test_layers(case, qgather):
    qgather.check(case)


def test_torchao_layers(torchao_case, qgather):
    qgather.check(torchao_case)
