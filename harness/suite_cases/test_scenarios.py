"""Optimizer steps with re-quantization on the shards (amax agreement across shards of very
different magnitudes), the in-place `out=` path of later unshards, and the hooks called around a
direct collective."""

from harness.suite import Sweep

SWEEP = Sweep(scenarios=("steps", "reshard", "hooks"), dtypes=("bf16",), world_sizes=(1, 2, 3))


def test_scenario(case, qgather):
    qgather.check(case)
