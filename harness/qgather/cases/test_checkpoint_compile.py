"""FSDP2 as training code configures it (issue 11): checkpoint resharding through
torch.distributed.checkpoint (`dcp-wsA`: saved at world size A, loaded at the case's B, gathered,
compared with the golden) and torch.compile around the gathered weight (`compile`: the compiled
forward bit for bit against the eager one). See qgather.scenarios.checkpoint, qgather.scenarios.compiled.

`dcp-wsA-trained` saves after one training forward at A (what a training run's checkpoint holds).
The default run is the checkpoint design of qgather.suite.config_sweep (`CHECKPOINT`): per format, a
covering design in which every pair of a checkpoint token (dcp-ws1..4, dcp-ws2-trained), compile,
a loading world size B (1..4) and a shape regime (judged where the checkpoint was saved and where
it is loaded: qgather.suite.config_regimes) occurs, compile at B = 1 or 2 only (each rank traces the
same graph: qgather.suite.config_space.compile_world_size_problem), plus the cases of two TE findings
(`FINDINGS`).
torchao (and its precomputed scales) runs its own sets unless --impl names the implementations.
`-m slow` adds the full product of A, B in 1..8 on an aligned and an uneven shape, and compile with
the hand-picked shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from qgather.formats import FORMATS
from qgather.model.config import FsdpConfig
from qgather.suite.config_sweep import CHECKPOINT, ConfigSweep
from qgather.suite.selection import runnable
from qgather.suite.sweeps import CaseSet, K, Sweep, alignment_shapes

COMPILE = FsdpConfig(compile=True)
TRAINED = FsdpConfig(saved_at_world_size=2, saved_after_forward=True)  # saved after a training forward
TORCHAO_IMPLS = ("torchao", "torchao:precompute")


def dcp(saved: int) -> FsdpConfig:
    return FsdpConfig(saved_at_world_size=saved)


def _units(fmt: str) -> int:
    return max(FORMATS[fmt].row_block, 16)


def two_shapes(fmt: str) -> list[tuple[int, ...]]:
    """Aligned at 1, 2, 4 and 8 ranks (8u rows), and uneven at 2 and 3 ranks (3u - 2)."""
    u = _units(fmt)
    return [(8 * u, K), (3 * u - 2, K)]


def aligned_shape(fmt: str) -> list[tuple[int, ...]]:
    return [(8 * _units(fmt), K)]


def dcp_sweeps(pairs: Sequence[tuple[int, int]], shapes=two_shapes, formats=None) -> list[Sweep]:
    """One sweep per loading world size B, crossing the source world sizes A saved for it."""
    by_b: dict[int, list[int]] = {}
    for a, b in pairs:
        by_b.setdefault(b, []).append(a)
    return [Sweep(scenarios=("gather",), dtypes=("bf16",), world_sizes=(b,), shapes=shapes, formats=formats,
                  configs=tuple(dcp(a) for a in sources)) for b, sources in sorted(by_b.items())]


def findings_shape(fmt: str) -> list[tuple[int, ...]]:
    return [(1024, K)]


# The checkpoint cases of two TE findings (docs/findings.md#te-blockwise-checkpoint-tile-split, the
# trained save after it) whose shape the design no longer draws: kept so that the findings stay run.
FINDINGS = [Sweep(scenarios=("gather",), dtypes=("bf16",), world_sizes=(b,), shapes=findings_shape,
                  formats=("fp8_block",), configs=(config,)) for b, config in ((2, dcp(3)), (4, TRAINED))]

def one_row(fmt: str) -> list[tuple[int, ...]]:
    return [(1, 16)]


# Ranks without rows loading a per-tensor checkpoint (mutant:empty_shard_stale_scale's bug: the empty
# shard's scale, which the load never writes): the design holds one case per (token, regime) pair, too
# few for a bug that needs both; a 1-row weight at 2, 3 and 4 ranks from checkpoints saved at 1, 2 and 4.
EMPTY_SHARDS = [Sweep(scenarios=("gather",), dtypes=("bf16",), world_sizes=(2, 3, 4), shapes=one_row,
                      formats=("fp8_tensor", "fp8_tensor_e5m2"), configs=(dcp(saved),)) for saved in (1, 2, 4)]

SWEEP = CaseSet([ConfigSweep(CHECKPOINT), *FINDINGS, *EMPTY_SHARDS])

# torchao: float8 per-tensor only; even shards at B (its uneven gathers are known failures on gloo,
# docs/findings.md), uneven ones at A = 3 (saving needs no gather).
TORCHAO = CaseSet([
    *dcp_sweeps(((2, 4), (4, 2), (2, 2), (1, 2), (4, 1), (3, 2)), shapes=aligned_shape, formats=("fp8_tensor",)),
    Sweep(scenarios=("gather",), dtypes=("bf16",), world_sizes=(1, 2), shapes=aligned_shape,
          formats=("fp8_tensor",), configs=(COMPILE,)),
    Sweep(scenarios=("gather",), dtypes=("bf16",), world_sizes=(4,), shapes=aligned_shape,
          formats=("fp8_tensor",), configs=(TRAINED,)),
])

EXHAUSTIVE = CaseSet([
    *dcp_sweeps([(a, b) for a in range(1, 9) for b in range(1, 9)]),
    Sweep(scenarios=("gather", "steps"), dtypes=("bf16",), world_sizes=(1, 2, 3, 4, 8), shapes=alignment_shapes,
          configs=(COMPILE,)),
], marks=("slow",))


def _asked_for_slow(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return "slow" in expr and "not slow" not in expr

#: torchao's own set, run beside the default run's cases (no --impl): `qgather list --cases` lists it too
COMPANIONS = (TORCHAO, TORCHAO_IMPLS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`torchao_case` (torchao's own sets, when --impl is not given) and `exhaustive_case` (the full
    product, marked slow, for the session's implementations)."""
    # deferred: `qgather list --cases` imports this module for its SWEEP alone, without the plugin
    from qgather.pytest_plugin.collection import parametrize_companion
    from qgather.pytest_plugin.options import settings

    if "torchao_case" in metafunc.fixturenames:
        parametrize_companion(metafunc, "torchao_case", TORCHAO, TORCHAO_IMPLS)
    if "exhaustive_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    if not _asked_for_slow(config):
        metafunc.parametrize("exhaustive_case", [])  # one skipped test: `make test` passes no -m slow
        return
    options = settings(config)
    specs = EXHAUSTIVE.cases(list(options.impls) if options.impls_named else ["reference"],
                             formats=options.formats, world_sizes=options.world_sizes, scenarios=options.scenarios)
    specs = runnable(specs, None, options.run.device_type())  # what each implementation declares
    marks = [getattr(pytest.mark, m) for m in EXHAUSTIVE.marks]
    metafunc.parametrize("exhaustive_case", [pytest.param(c, id=c.id, marks=marks) for c in specs])


def test_config(case, qgather):
    qgather.check(case)


def test_torchao_config(torchao_case, qgather):
    qgather.check(torchao_case)


def test_config_exhaustive(exhaustive_case, qgather):
    qgather.check(exhaustive_case)
