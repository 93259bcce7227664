"""The full product of the FSDP2 configuration design's space (qgather.suite.config_sweep): `-m slow`."""

from qgather.suite.config_sweep import FSDP, TORCHAO_BESIDE, ConfigSweep

SWEEP = ConfigSweep(FSDP, product=True, marks=("slow",), companions=TORCHAO_BESIDE)


def test_fsdp_config_product(case, qgather):
    qgather.check(case)
