# tests/test_fsdp2_gather.py in your library
from qgather.suite.sweeps import Sweep

IMPLS = ["mypkg.adapters:MyImpl"]
SWEEP = Sweep(scenarios=("gather", "steps"), formats=("fp8_tensor",), world_sizes=(1, 2))


def test_gather(case, qgather):          # one pytest test per case id
    qgather.check(case)                  # fails with the mismatch report unless the verdict is accepted
