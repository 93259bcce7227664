"""Warm rank pools: run a case function on every rank of a process group, contain every failure.

    spec = PoolSpec(backend="gloo", world_size=4, device="cpu")   # PoolSpec.auto(4) picks by GPUs
    spec.validate()                                   # PoolSpecError: one line saying why not
    out = get_pool(spec).run(fn, *args, timeout=30.0, case_id="...", seed=0)
    out.status                                        # OutcomeStatus.OK | ERROR | HANG | CRASH
    out.results, out.errors, out.stacks, out.exit_codes, out.duration_s, out.headline()
    same_error_on_every_rank(out.errors, out.world_size)  # the lowest rank's RankError, or None
    shutdown_pools()                                  # also registered with atexit

`fn(ctx: CaseContext, *args)` must be a module-level function; it runs on every rank after a
barrier and `torch.manual_seed(seed)`, and returns something picklable (tensors come back on
the CPU). A pool is per process (so per pytest-xdist worker) and per spec; its ranks start on
the first case, stay warm, and are respawned on the next case after a hang, a crash, or an
error that left some rank behind. Under torchrun/SLURM, get_pool returns an ExternalPool bound
to the launcher's world instead, with the same `run`. The runtime knows nothing of cases: runner
and ranks speak the closed protocol of runtime/protocol.py.

Modules: spec (what a pool is), pool (the runner side), replies (what one exchange got back, and
when the pool looks again), rank (the rank side), protocol (their messages), outcome (what a case
run returns), whereabouts (where a running case is), helpers (the forkserver and resource
tracker), lifeline (nothing outlives the runner), registry (one pool per spec, started side by
side), gpu_lease (the seats a CUDA pool's ranks take on GPUs that every pool of the run shares; its
directory and locks: lease_files; a waiter's ask for seats: seat_want),
launch/job/external (ranks a launcher started), probes and bench (the runtime's benchmark).

Environment knobs: QGATHER_START_METHOD=spawn (instead of a forkserver with torch preloaded),
QGATHER_GPU_LEASE_DIR / QGATHER_GPU_LEASE_TIMEOUT / QGATHER_GPU_SEATS (the run's GPU seats, gpu_lease),
QGATHER_PIN_CPUS=0 (no CPU pinning of CPU ranks).
"""

from qgather.runtime.external import ExternalPool
from qgather.runtime.launch import external_world, is_reporting_rank
from qgather.runtime.outcome import CaseOutcome, OutcomeStatus, RankError, same_error_on_every_rank
from qgather.runtime.pool import RankPool
from qgather.runtime.protocol import ProtocolError
from qgather.runtime.rank import CaseContext
from qgather.runtime.registry import (
    get_pool,
    is_cold,
    is_up,
    shutdown_pools,
    start_ahead,
    starting_in_background,
)
from qgather.runtime.spec import PoolSpec, PoolSpecError, visible_gpus

__all__ = [
    "CaseContext",
    "CaseOutcome",
    "ExternalPool",
    "OutcomeStatus",
    "PoolSpec",
    "PoolSpecError",
    "ProtocolError",
    "RankError",
    "RankPool",
    "external_world",
    "get_pool",
    "is_cold",
    "is_reporting_rank",
    "is_up",
    "same_error_on_every_rank",
    "shutdown_pools",
    "start_ahead",
    "starting_in_background",
    "visible_gpus",
]
