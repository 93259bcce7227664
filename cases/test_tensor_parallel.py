"""Tensor parallel + FSDP2 on a 2-D ("dp", "tp") mesh: gathers, steps, reshard and checkpoints.

Defined in qgather.cases.test_tensor_parallel, so that an installed qgather carries it."""

from qgather.cases.test_tensor_parallel import SWEEP, test_tensor_parallel  # noqa: F401 - pytest collects them here
