"""FSDP2 as training code configures it (issue 11): mixed precision, reshard_after_forward, HSDP
meshes (shard or replicate size 1 included) and dim-1 sharding, crossed with the shape regimes of
each format (zero-row ranks, uneven last shards, 3-D experts, block-splitting shards, partial tails,
M below the world size) as a covering design: every pair of a configuration token, a regime, a
scenario, a world size and a dtype that can occur, per format (qgather.suite.config_sweep). With the
default --impl, torchao runs beside the reference, without the regimes where it is a known failure
(TORCHAO_BESIDE). The full product is test_fsdp_configs_full (slow)."""

from qgather.suite.config_sweep import FSDP, TORCHAO_BESIDE, ConfigSweep

SWEEP = ConfigSweep(FSDP, companions=TORCHAO_BESIDE)


def test_fsdp_config(case, qgather):
    qgather.check(case)
