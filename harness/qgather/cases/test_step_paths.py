"""torch.compile and the step paths crossed with the other configuration tokens (issue 33): the
`steps` and `reshard` scenarios under every pair of compile, a checkpoint resharded into them
(dcp-ws2, dcp-ws4), mixed precision, reshard_after_forward, HSDP and dim-1 sharding, and the shape
regimes of each format, as a covering design (qgather.suite.config_sweep.STEP_PATHS), deepened so
that every (scenario, token) pair runs on shapes of three regimes."""

from qgather.suite.config_sweep import STEP_PATHS, ConfigSweep

SWEEP = ConfigSweep(STEP_PATHS)


def test_step_paths(case, qgather):
    qgather.check(case)
