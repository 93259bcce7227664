"""A small model of the library's own layers trained sharded, against the same model on one device.

Defined in qgather.cases.test_model, so that an installed qgather carries it."""

from qgather.cases.test_model import SWEEP, test_model  # noqa: F401 - pytest collects them here
