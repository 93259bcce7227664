"""Tensor parallel + FSDP2 (`tp-DxT`, `tp-DxT-row`; issue 24): the weight distributed on the "tp" mesh
dimension with a tensor-parallel style, then fully_shard on "dp"; gathers, optimizer steps, the
`out=` re-gather and checkpoints across a change of the dp size, every TP rank's gathered piece
against its slice of the one-device golden. A covering design of format x mesh x scenario x dtype
(qgather.suite.tp_sweep); `--exhaustive` runs the full product (slow). With the default --impl,
torchao with precomputed scales runs beside the reference; plain torchao where --impl names it."""

from qgather.model.config import FsdpConfig
from qgather.suite.sweeps import CaseSet, Sweep
from qgather.suite.tp_sweep import TensorParallelSweep


def eight_units(fmt: str) -> list[tuple[int, ...]]:
    return [(128, 64)]


#: optimizer steps under a 2 x 2 mesh, column- and row-wise, for the formats with a per-tensor amax
#: (mutant:amax_over_dp_only's bug: a step's amax reduced over dp only): the design holds one or two
#: such cases per format
PER_TENSOR_STEPS = [Sweep(scenarios=("steps", "reshard"), dtypes=("bf16",), world_sizes=(4,), shapes=eight_units,
                          formats=("fp8_tensor", "fp8_tensor_e5m2", "nvfp4_1d", "nvfp4_2d"), configs=(config,))
                    for config in (FsdpConfig(tp=(2, 2)), FsdpConfig(tp=(2, 2), tp_style="row"))]

SWEEP = CaseSet([TensorParallelSweep(), *PER_TENSOR_STEPS])


def test_tensor_parallel(case, qgather):
    qgather.check(case)
