"""Alignment sweep: every format, shapes that respect and that violate its row block.

Defined in qgather.cases.test_alignment, so that an installed qgather carries it."""

from qgather.cases.test_alignment import SWEEP, test_gather  # noqa: F401 - pytest collects them here
