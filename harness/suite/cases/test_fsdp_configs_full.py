"""The full product of the FSDP2 configuration dimensions (qgather.suite.config_sweep): `-m slow`."""

from qgather.suite.config_sweep import ConfigSweep

SWEEP = ConfigSweep(product=True, marks=("slow",))


def test_fsdp_config_product(case, qgather):
    qgather.check(case)
