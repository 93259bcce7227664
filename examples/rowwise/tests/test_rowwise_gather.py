# tests/test_rowwise_gather.py in your library: the adapter lists its format, so its cases are known
from qgather.suite.sweeps import Sweep

IMPLS = ["rowpkg.adapter:RowwiseImpl"]
SWEEP = Sweep(scenarios=("gather", "steps"), formats=("fp8_rowwise",), world_sizes=(1, 2))


def test_gather(case, qgather):          # one pytest test per case id
    qgather.check(case)                  # fails with the mismatch report unless the verdict is accepted
