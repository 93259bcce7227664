"""Virtual worlds: one process emulates FSDP2's chunking, up to 1024 ranks.

Defined in qgather.cases.test_virtual, so that an installed qgather carries it."""

from qgather.cases.test_virtual import SWEEP, test_virtual, test_virtual_agrees_with_real_gathers  # noqa: F401 - pytest collects them here
