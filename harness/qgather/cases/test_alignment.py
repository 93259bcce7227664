"""Alignment sweep: every format, shapes that respect and that violate its row block, every CPU
world size, a real FSDP2 unshard; and tensor parallel splits that cut the format's blocks (a TP
piece, or a dp shard of one: qgather.suite.tp_sweep.TensorParallelAlignment). Aligned shapes must be
EXACT; violations EXACT or REJECTED."""

from qgather.suite.sweeps import CaseSet, Sweep
from qgather.suite.tp_sweep import TensorParallelAlignment

SWEEP = CaseSet([Sweep(scenarios=("gather",), dtypes=("bf16",)), TensorParallelAlignment()])


def test_gather(case, qgather):
    qgather.check(case)
