"""fp32 masters: the alignment policy on a narrower set of world sizes.

Defined in qgather.cases.test_masters, so that an installed qgather carries it."""

from qgather.cases.test_masters import SWEEP, test_gather_fp32  # noqa: F401 - pytest collects them here
