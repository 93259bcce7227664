"""A transformer-like block: every parameter in one fully_shard group, gathered, stepped, re-gathered.

Defined in qgather.cases.test_block, so that an installed qgather carries it."""

# Names in definition order (not sorted): pytest runs a module's tests in the order it holds them.
from qgather.cases.test_block import (  # noqa: F401, I001 - pytest collects them (and the hook) here
    SWEEP,
    COMPANIONS,
    pytest_generate_tests,
    test_block,
    test_torchao_block,
)
