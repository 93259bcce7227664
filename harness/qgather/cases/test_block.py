"""A transformer-like block: every parameter in ONE fully_shard group (the block scenario:
qgather.scenarios.block; its parameters: qgather.model.block). A case's shape is the block's first
quantized weight, picked as the layers suite picks it (qgather.cases.test_layers.FirstWeights:
uneven shards that stay aligned, and shards that split a scale block, which the reference refuses:
the case is then REJECTED after the rest of the block was judged EXACT); the block adds an aligned
weight, a weight in another format, a 3-D experts weight and plain parameters between them, so every
case holds three regimes and two formats in one flat buffer. Every format at 2, 3 and 4 ranks, the
block as the root, with zero-row and aligned first weights too (at least 10 cases over three shape
classes per format: qgather.suite.depth); mp-bf16, raf-no and hsdp-2x2 on every format; compile and
`nested` (the block inside a model root with a parameter of its own, at 2 and 3 ranks) on three
formats (per tensor, blockwise, NVFP4); torchao (its own set unless --impl names
the implementations) with and without precomputed scales, eager and compiled.
"""

from __future__ import annotations

import pytest

from qgather.cases.test_layers import FirstWeights, even_first
from qgather.model.config import FsdpConfig
from qgather.suite.sweeps import CaseSet, Sweep

SCENARIO = ("block",)
TORCHAO_IMPLS = ("torchao", "torchao:precompute")
#: the configurations the block runs on every format, each at the world size it needs
CONFIGS = (
    (FsdpConfig(param_dtype="bf16"), "fp32", 2),
    (FsdpConfig(reshard_after_forward=False), "bf16", 2),
    (FsdpConfig(hsdp=(2, 2)), "bf16", 4),
)
#: and on three formats (per tensor, blockwise, NVFP4): a compiled block forward costs ~5 s on CI
CONFIGS_OF_THREE = (
    (FsdpConfig(compile=True), "bf16", 2),
    (FsdpConfig(nested=True), "bf16", 2),
    (FsdpConfig(nested=True), "bf16", 3),
)
CONFIG_FORMATS = ("fp8_tensor", "fp8_block", "nvfp4_2d")

SWEEP = CaseSet([
    Sweep(scenarios=SCENARIO, dtypes=("bf16",), world_sizes=(2, 3, 4),
          shapes=FirstWeights(zero_row=True, aligned_at=(2, 3, 4))),
    *(Sweep(scenarios=SCENARIO, dtypes=(dtype,), world_sizes=(ws,), shapes=FirstWeights(split=False),
            configs=(config,)) for config, dtype, ws in CONFIGS),
    *(Sweep(scenarios=SCENARIO, dtypes=(dtype,), world_sizes=(ws,), shapes=FirstWeights(split=False),
            formats=CONFIG_FORMATS, configs=(config,)) for config, dtype, ws in CONFIGS_OF_THREE),
])

TORCHAO = CaseSet([
    Sweep(scenarios=SCENARIO, dtypes=("bf16",), world_sizes=(2,), shapes=even_first, formats=("fp8_tensor",)),
    Sweep(scenarios=SCENARIO, dtypes=("bf16",), world_sizes=(2,), shapes=even_first, formats=("fp8_tensor",),
          configs=(FsdpConfig(compile=True),)),
])


#: torchao's own set, run beside the default run's cases (no --impl): `qgather list --cases` lists it too
COMPANIONS = (TORCHAO, TORCHAO_IMPLS)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`torchao_case`: torchao's own set, when --impl does not name the implementations."""
    # deferred: `qgather list --cases` imports this module for its SWEEP alone, without the plugin
    from qgather.pytest_plugin.collection import parametrize_companion

    if "torchao_case" in metafunc.fixturenames:
        parametrize_companion(metafunc, "torchao_case", TORCHAO, TORCHAO_IMPLS)


def test_block(case, qgather):
    qgather.check(case)


def test_torchao_block(torchao_case, qgather):
    qgather.check(torchao_case)
