"""Virtual worlds: one process emulates FSDP2's chunking, padding and concatenation, for sweeps
up to 1024 ranks that no pool could run."""

from harness.suite import Sweep

SWEEP = Sweep(scenarios=("virtual",), dtypes=("bf16",), world_sizes=(1, 2, 3, 4, 8, 16, 64, 256, 1024))


def test_virtual(case, qgather):
    qgather.check(case)
