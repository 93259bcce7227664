"""The full product of the FSDP2 configuration dimensions (slow).

Defined in qgather.cases.test_fsdp_configs_full, so that an installed qgather carries it."""

from qgather.cases.test_fsdp_configs_full import SWEEP, test_fsdp_config_product  # noqa: F401 - pytest collects them here
