"""fp32 masters (the alignment sweep runs bf16): same policy, a narrower set of world sizes."""

from qgather.suite.sweeps import LEAN_SHAPES, Sweep

SWEEP = Sweep(scenarios=("gather",), dtypes=("fp32",), world_sizes=(2, 3), shapes=LEAN_SHAPES)


def test_gather_fp32(case, qgather):
    qgather.check(case)
