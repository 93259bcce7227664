"""Optimizer steps with re-quantization on the shards (amax agreement across shards of very
different magnitudes), the in-place `out=` path of later unshards, and the hooks called around a
direct collective, at every CPU world size with two seeds (crossed pairwise with the shapes:
qgather.suite.covering; `--exhaustive` runs every shape with every seed)."""

from qgather.suite.sweeps import CPU_WORLD_SIZES, LEAN_SHAPES, Sweep

SWEEP = Sweep(scenarios=("steps", "reshard", "hooks"), dtypes=("bf16",), world_sizes=CPU_WORLD_SIZES, seeds=(0, 1),
              shapes=LEAN_SHAPES)


def test_scenario(case, qgather):
    qgather.check(case)
