"""FSDP2 configurations (mixed precision, reshard_after_forward, HSDP, dim-1 sharding), pairwise.

Defined in qgather.cases.test_fsdp_configs, so that an installed qgather carries it."""

from qgather.cases.test_fsdp_configs import SWEEP, test_fsdp_config  # noqa: F401 - pytest collects them here
