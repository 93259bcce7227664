"""One pool per (backend, world size, device) per process, and their teardown."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Collection

from qgather.runtime.external import ExternalPool
from qgather.runtime.gpu_lease import remove_own_lease_dir
from qgather.runtime.helpers import stop_helpers
from qgather.runtime.launch import external_world
from qgather.runtime.pool import RankPool
from qgather.runtime.spec import PoolSpec

_pools: dict[PoolSpec, RankPool | ExternalPool] = {}
_lock = threading.Lock()
_atexit_registered = False


def get_pool(spec: PoolSpec, say: Callable[[str], None] | None = None) -> RankPool | ExternalPool:
    """The pool for `spec`, created on first request (its ranks start on its first case).

    Under torchrun/SLURM this is an ExternalPool bound to the launcher's world instead, which writes
    this rank's own failures with `say` (default: stderr).
    """
    global _atexit_registered
    with _lock:
        pool = _pools.get(spec)
        if pool is None:
            world = external_world()
            pool = ExternalPool(spec, world, say) if world is not None else RankPool(
                spec, before_lease_wait=lambda: release_gpu_pools(keep=(spec,)))
            _pools[spec] = pool
            if not _atexit_registered:
                atexit.register(shutdown_pools)
                _atexit_registered = True
        return pool


def release_gpu_pools(keep: Collection[PoolSpec] = ()) -> None:
    """Stop this process's NCCL pools other than `keep`, giving their GPUs back to the run's lease.

    Called before a pool waits for GPUs (a process never waits while holding some) and between
    cases when the next case needs other pools (pytest_plugin.gpu_schedule)."""
    with _lock:
        idle = [spec for spec, pool in _pools.items()
                if spec.backend == "nccl" and spec not in keep and isinstance(pool, RankPool) and pool.started]
        pools = [_pools[spec] for spec in idle]
    for pool in pools:
        pool.shutdown()


def shutdown_pools(keep_helpers: bool = False) -> None:
    """Stop every pool's ranks, remove their temp dirs, and stop the forkserver if ours.

    keep_helpers: leave the forkserver (torch preloaded) and resource tracker running, for a
    process that starts pools again (a test module's clean slate; restarting costs seconds).
    """
    with _lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown()
    if not keep_helpers:
        stop_helpers()
        remove_own_lease_dir()
