"""Alignment sweep: every format, shapes that respect and that violate its row block, every CPU
world size, a real FSDP2 unshard. Aligned shapes must be EXACT; violations EXACT or REJECTED."""

from qgather.suite.sweeps import Sweep

SWEEP = Sweep(scenarios=("gather",), dtypes=("bf16",))


def test_gather(case, qgather):
    qgather.check(case)
