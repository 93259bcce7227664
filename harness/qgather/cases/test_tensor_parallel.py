"""Tensor parallel + FSDP2 (`tp-DxT`, `tp-DxT-row`; issue 24): the weight distributed on the "tp" mesh
dimension with a tensor-parallel style, then fully_shard on "dp"; gathers, optimizer steps, the
`out=` re-gather and checkpoints across a change of the dp size, every TP rank's gathered piece
against its slice of the one-device golden. A covering design of format x mesh x scenario x dtype
(qgather.suite.tp_sweep); `--exhaustive` runs the full product (slow). With the default --impl,
torchao with precomputed scales runs beside the reference; plain torchao where --impl names it."""

from qgather.suite.tp_sweep import TensorParallelSweep

SWEEP = TensorParallelSweep()


def test_tensor_parallel(case, qgather):
    qgather.check(case)
