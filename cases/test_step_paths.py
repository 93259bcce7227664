"""torch.compile and the step paths (steps, reshard, checkpoint resharding) crossed pairwise with the
other configuration tokens.

Defined in qgather.cases.test_step_paths, so that an installed qgather carries it."""

from qgather.cases.test_step_paths import SWEEP, test_step_paths  # noqa: F401 - pytest collects them here
