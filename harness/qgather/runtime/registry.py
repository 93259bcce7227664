"""One pool per (backend, world size, device) per process, a standby beside a CUDA pool that failed
cases empty, and their teardown."""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Collection

from qgather.runtime.external import ExternalPool
from qgather.runtime.helpers import stop_helpers
from qgather.runtime.launch import external_world
from qgather.runtime.lease_files import POLL_S, LeaseTimeout, remove_own_lease_dir
from qgather.runtime.pool import RankPool
from qgather.runtime.seat_want import claim_seats, seats_wanted, someone_waits
from qgather.runtime.spec import PoolSpec

_pools: dict[PoolSpec, RankPool | ExternalPool] = {}
# A second pool of a spec whose pool a failed case left without ranks once (_standby_for): started in the
# background once that pool is up again, it takes the case after the next failure while the emptied one
# restarts, and so on, turn about.
_standby: dict[PoolSpec, RankPool] = {}
STANDBY_ENV = "QGATHER_STANDBY_POOLS"  # "0": no standby pools (a restart's wait falls on the next case)
_lock = threading.Lock()
_atexit_registered = False
# This process's seat yielder (_start_yielder): per process by nature, like the pools it stops.
_yielder: threading.Thread | None = None
YIELD_POLL_S = 5 * POLL_S  # how often a process looks whether another one waits for GPU seats
IN_USE_WAIT_S = 10.0  # the most shutdown_pools waits for the yielder to finish stopping a pool


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
            pool = ExternalPool(spec, world, say) if world is not None else _rank_pool(spec)
            _pools[spec] = pool
            if spec.device == "cuda" and world is None:
                _start_yielder()
            if not _atexit_registered:
                atexit.register(shutdown_pools)
                _atexit_registered = True
        elif isinstance(pool, RankPool):
            pool = _standby_for(spec, pool)
        return pool


def start_ahead(spec: PoolSpec) -> bool:
    """The pool for `spec` starts in the background unless it is up or starting already (a pool a case
    will need soon); whether it began to. Nothing under a launcher, whose world is up (and whose pool
    writes with the case's `say`)."""
    if external_world() is not None:
        return False
    pool = get_pool(spec)
    if not _cold(pool):
        return False
    pool.start_in_background()
    return True


def is_cold(spec: PoolSpec) -> bool:
    """Whether a case of `spec` would start its pool's ranks: none made yet, or made but neither up nor
    starting in the background; never under a launcher, whose world is up."""
    if external_world() is not None:
        return False
    with _lock:
        pool = _pools.get(spec)
    return pool is None or _cold(pool)


def is_up(spec: PoolSpec) -> bool:
    """Whether a case of `spec` would find its pool's ranks up (not starting); always under a launcher."""
    if external_world() is not None:
        return True
    with _lock:
        pool = _pools.get(spec)
    return isinstance(pool, RankPool) and pool.started and not pool.restart.under_way


def _cold(pool: RankPool | ExternalPool) -> bool:
    return isinstance(pool, RankPool) and not pool.started and not pool.restart.under_way


def starting_in_background() -> bool:
    """Whether one of this process's pools is starting (or restarting) in the background now."""
    with _lock:
        pools = [*_pools.values(), *_standby.values()]
    return any(isinstance(pool, RankPool) and pool.restart.under_way for pool in pools)


def _standby_for(spec: PoolSpec, pool: RankPool) -> RankPool:
    """The pool a case of `spec` should use (under _lock). A pool restarting in the background (a failed
    case left it without ranks) hands the case to its standby if that is up, and becomes the standby.
    A pool that has been restarted once gets a standby, started in the background while the pool is up
    (not beside a restart: CUDA contexts made at once queue on the GPU). On the GPU gate a restart cost
    the next case ~6 s, 20% of all case time on 1 x H200 (docs/gpu-results.md, run E)."""
    if not pool.restarts_in_background or os.environ.get(STANDBY_ENV) == "0":
        return pool
    standby = _standby.get(spec)
    if pool.restart.under_way:
        if standby is not None and standby.started and not standby.restart.under_way:
            _pools[spec], _standby[spec] = standby, pool
            return standby
        return pool
    if pool.spawn_count > 1 and standby is None and not someone_waits():
        # started once, here: a standby whose start failed, or that the seat yielder stopped, is not
        # started again case after case (as the pool in use it restarts after a failure, as any pool does).
        # Not while another process waits for GPU seats: a standby is a spare, not worth a worker's wait.
        standby = _standby[spec] = _rank_pool(spec)
        standby.start_in_background()
    return pool


def _rank_pool(spec: PoolSpec) -> RankPool:
    """A pool of this process's own ranks; before waiting for GPU seats it stops this process's idle pools."""
    return RankPool(spec, before_lease_wait=lambda: release_gpu_pools(keep=(spec,)))


def release_gpu_pools(keep: Collection[PoolSpec] = ()) -> int:
    """Stop this process's idle CUDA pools other than `keep`, giving their GPU seats back; how many it
    stopped. A pool running a case is never stopped. Called before a pool waits for seats: a process
    never waits while holding idle ones."""
    stopped = 0
    for pool in _stoppable(keep):
        if not pool.in_use.acquire(blocking=False):
            continue
        try:
            if pool.started:
                pool.shutdown()
                stopped += 1
        finally:
            pool.in_use.release()
    return stopped


def yield_seats_wanted() -> bool:
    """For another process of the run that waits for GPU seats: claim an idle pool's seats from its
    shortfall, then stop that pool; whether one was stopped. Nothing is stopped once the shortfall is
    claimed, so the other workers' pools stay warm (each stopped one costs its next case a start)."""
    for pool in _stoppable(()):
        if not pool.in_use.acquire(blocking=False):
            continue
        try:
            if pool.started:
                return _stop_claimed(pool)
        finally:
            pool.in_use.release()
    return False


def _stop_claimed(pool: RankPool) -> bool:
    """Stop `pool` (idle, its in_use held) if the waiter still lacks seats; a stop that raises gives
    the claim back, so that another process's pool frees them."""
    claim = claim_seats(pool.spec.world_size)  # a rank per seat
    if claim is None:
        return False
    try:
        pool.shutdown()
    except BaseException:
        claim.give_back()
        raise
    return True


def _stoppable(keep: Collection[PoolSpec]) -> list[RankPool]:
    """This process's CUDA pools but `keep`, in the order they give their seats up: standby pools
    first (spares, idle between failures, where a stopped pool in use costs its next case a start),
    then the widest first."""
    with _lock:
        standbys = [pool for spec, pool in _standby.items() if spec.device == "cuda"]
        in_use = [pool for spec, pool in _pools.items()
                  if spec.device == "cuda" and spec not in keep and isinstance(pool, RankPool)]
    return _widest_first(standbys) + _widest_first(in_use)


def _widest_first(pools: list[RankPool]) -> list[RankPool]:
    return sorted(pools, key=lambda p: -p.spec.world_size)


def _start_yielder() -> None:
    """Once per process that has CUDA pools: a daemon thread that, while another process of the run
    waits for GPU seats that nobody has claimed yet, stops one of this process's idle CUDA pools at a
    time (yield_seats_wanted), so that a worker waiting for its next test (or finishing a long case)
    never sits on seats another one needs."""
    global _yielder
    if _yielder is None or not _yielder.is_alive():
        _yielder = threading.Thread(target=_yield_seats, name="qgather-seat-yielder", daemon=True)
        _yielder.start()


def _yield_seats() -> None:
    while True:
        time.sleep(YIELD_POLL_S)
        if seats_wanted() > 0:
            try:
                yield_seats_wanted()
            except LeaseTimeout:
                pass  # the want lock stayed held (a frozen process): the next poll tries again


def shutdown_pools(keep_helpers: bool = False) -> None:
    """Stop every pool's ranks, remove their temp dirs, and stop the forkserver if ours.

    keep_helpers: leave the forkserver (torch preloaded) and resource tracker running, for a
    process that starts pools again (a test module's clean slate; restarting costs seconds).
    """
    with _lock:
        pools = [*_pools.values(), *_standby.values()]
        _pools.clear()
        _standby.clear()
    for pool in pools:
        # Not under the yielder's feet; bounded, since a case this very thread left may hold it.
        held = pool.in_use.acquire(timeout=IN_USE_WAIT_S) if isinstance(pool, RankPool) else False
        try:
            pool.shutdown()
        finally:
            if held:
                pool.in_use.release()
    if not keep_helpers:
        stop_helpers()
        remove_own_lease_dir()
