"""FSDP2 as training code configures it (issue 11): mixed precision, reshard_after_forward, HSDP
meshes (shard or replicate size 1 included) and dim-1 sharding, crossed as a covering design (every
pair of dimension values at least once: qgather.suite.config_sweep). With the default --impl, torchao runs
beside the reference. The full product is test_fsdp_configs_full (marked slow)."""

from qgather.suite.config_sweep import ConfigSweep

SWEEP = ConfigSweep()


def test_fsdp_config(case, qgather):
    qgather.check(case)
