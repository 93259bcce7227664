"""Checkpoint resharding (torch.distributed.checkpoint, saved at A, loaded at B) and torch.compile
around the gathered weight.

Defined in qgather.cases.test_checkpoint_compile, so that an installed qgather carries it."""

# Names in definition order (not sorted): pytest runs a module's tests in the order it holds them.
from qgather.cases.test_checkpoint_compile import (  # noqa: F401, I001 - pytest collects them (and the hook) here
    SWEEP,
    COMPANIONS,
    pytest_generate_tests,
    test_config,
    test_torchao_config,
    test_config_exhaustive,
)
