"""Modules of several quantized weights, each gathered and judged in one forward, then steps.

Defined in qgather.cases.test_layers, so that an installed qgather carries it."""

# Names in definition order (not sorted): pytest runs a module's tests in the order it holds them.
from qgather.cases.test_layers import (  # noqa: F401, I001 - pytest collects them (and the hook) here
    SWEEP,
    COMPANIONS,
    pytest_generate_tests,
    test_layers,
    test_torchao_layers,
)
