"""Optimizer steps with re-quantization, the in-place `out=` path, the hooks alone.

Defined in qgather.cases.test_scenarios, so that an installed qgather carries it."""

from qgather.cases.test_scenarios import SWEEP, test_scenario  # noqa: F401 - pytest collects them here
