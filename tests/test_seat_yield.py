"""Seat yielding between real processes on simulated GPUs (a real lease directory, the real registry's
yielder threads; only the pools' ranks are simulated): the yielders of several workers, answering one
waiter short of N seats, stop pools that free at least N seats and no pool beyond the one that covers
them; a claim whose pool cannot be stopped is given back; the waiter asks again where the claimed seats
came free on a GPU it does not need, and where a claim frees nothing once the free seats stop growing.
Each test takes about a second or less (a few forked processes, a few polls)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event

import pytest

from qgather.runtime import gpu_lease, registry, seat_want, spec
from qgather.runtime.pool import RankPool
from qgather.runtime.spec import PoolSpec

WAIT_S = 30.0  # bounds every wait here: a waiter never served fails the test instead of hanging it
SERVED_S = 10.0  # bounds a waiter served in about a second here: below WAIT_S, so it fails as a LeaseTimeout
STOP_S = 0.3  # a pool's stop (its ranks' exit): a few of the yielders' polls, as on a GPU
POOL = PoolSpec("gloo", 2, "cuda")  # 2 seats
ONE = PoolSpec("gloo", 1, "cuda")
WORKERS = 4  # each with a pool and a standby of POOL: 4 x 2 x 2 = 16 seats, the whole GPU
SEATS = WORKERS * 2 * POOL.world_size


class SeatedPool(RankPool):
    """An idle pool whose ranks are simulated: its seats are real; its stop takes STOP_S, during which
    it still holds them, as a real pool's ranks do until they are gone."""

    def __init__(self, pool_spec: PoolSpec, directory: str, gpus: list[str], seats: int) -> None:
        super().__init__(pool_spec)
        self._lease = gpu_lease.acquire(pool_spec.world_size, gpus, seats=seats, directory=directory, timeout=WAIT_S)

    @property
    def started(self) -> bool:
        return self._lease is not None and self._lease.held

    def shutdown(self) -> None:
        time.sleep(STOP_S)  # the stop's duration, not a synchronization
        if self._lease is not None:
            self._lease.release()


def _worker(index: int, directory: str, gpus: list[str], seats: int, pools: list[PoolSpec], ready: Event,
            yield_when: Callable[[], bool], done: Event, given: mp.Queue) -> None:
    """An xdist worker between cases: idle pools (the first in use, the others standbys) and the
    registry's yielder, started once `yield_when()`; at `done`, how many seats it gave up (once no stop
    is under way: each pool's in_use)."""
    try:
        os.environ[gpu_lease.LEASE_DIR_ENV] = directory
        spec.visible_gpus = lambda: gpus
        registry._pools.clear()  # forked: the parent's pools are not this worker's
        registry._standby.clear()
        for i, pool_spec in enumerate(pools):
            (registry._standby if i else registry._pools)[pool_spec] = SeatedPool(pool_spec, directory, gpus, seats)
        ready.set()
        if not yield_when():
            raise AssertionError("never told to yield")
        registry._start_yielder()
        if not done.wait(WAIT_S):
            raise AssertionError("never told the wait was over")
        held = [*registry._pools.values(), *registry._standby.values()]
        assert all(pool.in_use.acquire(timeout=WAIT_S) for pool in held)  # no stop under way now
        given.put((index, sum(pool.spec.world_size for pool in held if not pool.started)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        given.put((index, repr(exc)))


class Workers:
    """Forked workers, each seated before the next one starts (so the test knows where their seats are)."""

    def __init__(self, directory: str, gpus: list[str], seats: int) -> None:
        self.directory, self.gpus, self.seats = directory, gpus, seats
        self.ctx = mp.get_context("fork")
        self.given: mp.Queue = self.ctx.Queue()
        self.go, self.done = self.ctx.Event(), self.ctx.Event()
        self.processes: list[mp.Process] = []

    def add(self, pools: list[PoolSpec], yield_when: Callable[[], bool] | None = None) -> None:
        ready = self.ctx.Event()
        when = yield_when or (lambda: self.go.wait(WAIT_S))
        process = self.ctx.Process(target=_worker, args=(len(self.processes), self.directory, self.gpus, self.seats,
                                                         pools, ready, when, self.done, self.given))
        process.start()
        self.processes.append(process)
        assert ready.wait(WAIT_S)

    def seats_given_up(self) -> list[int]:
        """The seats each worker gave up, in the order they were added."""
        self.done.set()
        given = [seats for _, seats in sorted(self.given.get(timeout=WAIT_S) for _ in self.processes)]
        assert all(isinstance(seats, int) for seats in given), given
        return given

    def stop(self) -> None:
        self.done.set()
        for process in self.processes:
            process.join(timeout=WAIT_S)
            if process.is_alive():
                process.kill()

    def free(self) -> list[int]:
        return gpu_lease._free_seats(self.directory, len(self.gpus), self.seats)


def _until(condition: Callable[[], bool]) -> bool:
    """A bounded poll of `condition`."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(gpu_lease.POLL_S)
    return True


@pytest.mark.parametrize("short", [1, 3])
def test_the_yielders_stop_only_what_the_waiter_is_short_of(tmp_path, short):
    workers = Workers(str(tmp_path), ["0"], SEATS)
    try:
        for _ in range(WORKERS):
            workers.add([POOL, POOL])  # a pool and its standby
        assert workers.free() == [0]  # the GPU is full: the waiter is `short`
        workers.go.set()
        gpu_lease.acquire(short, ["0"], seats=SEATS, directory=str(tmp_path), timeout=SERVED_S).release()
        given = sum(workers.seats_given_up())
    finally:
        workers.stop()
    # a pool more than the shortfall needs is a pool that some worker's next case starts again
    assert short <= given <= short + POOL.world_size - 1, f"{given} seats given up for {short} missing"


def test_a_waiter_asks_again_when_the_claimed_seats_came_free_on_a_gpu_it_does_not_need(tmp_path, monkeypatch):
    """Two GPUs of 2 seats; GPU 0 full, GPU 1 half: a 2-rank NCCL pool is 1 seat short, on GPU 0. The
    first claim stops a pool on GPU 1, which does not help; once that seat is free the waiter asks
    again, at once (REARM_S, the bound for a claim that never comes free, is out of reach here)."""
    monkeypatch.setattr(seat_want, "REARM_S", 2 * WAIT_S)
    workers = Workers(str(tmp_path), ["0", "1"], 2)
    try:
        gpu1_free = lambda: _until(lambda: workers.free() == [0, 2])  # noqa: E731
        workers.add([ONE], yield_when=gpu1_free)  # on GPU 0 (ties: the lowest index)
        workers.add([ONE])  # on GPU 1: the first to yield
        workers.add([ONE], yield_when=gpu1_free)  # on GPU 0
        assert workers.free() == [0, 1]
        workers.go.set()
        gpu_lease.acquire(2, ["0", "1"], seats=2, directory=str(tmp_path), timeout=SERVED_S).release()
        given = workers.seats_given_up()
    finally:
        workers.stop()
    assert given[1] == 1 and given[0] + given[2] == 1  # GPU 1's pool, then one of GPU 0's


def test_a_claim_whose_pool_cannot_stop_is_given_back(tmp_path, monkeypatch):
    directory = str(tmp_path)
    monkeypatch.setenv(gpu_lease.LEASE_DIR_ENV, directory)
    monkeypatch.setattr(spec, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(registry, "_standby", {})
    stuck = SeatedPool(POOL, directory, ["0"], SEATS)
    monkeypatch.setattr(registry, "_pools", {POOL: stuck})

    def cannot_stop() -> None:
        raise OSError("the ranks did not stop")

    monkeypatch.setattr(stuck, "shutdown", cannot_stop)
    (tmp_path / seat_want.WANT).write_text(seat_want.Want(os.getpid(), 3).text())  # this process waits
    with pytest.raises(OSError, match="did not stop"):
        registry.yield_seats_wanted()
    assert seat_want.seats_wanted(directory) == 3  # missing again, for another worker's pool
    stuck._lease.release()


def test_claims_take_the_shortfall_down_to_nothing(tmp_path):
    directory = str(tmp_path)
    (tmp_path / seat_want.WANT).write_text(seat_want.Want(os.getpid(), 3).text())
    first = seat_want.claim_seats(2, directory)
    second = seat_want.claim_seats(2, directory)
    assert first is not None and second is not None and seat_want.seats_wanted(directory) == 0
    assert seat_want.claim_seats(1, directory) is None and seat_want.someone_waits(directory)  # claimed in full
    second.give_back()
    assert seat_want.seats_wanted(directory) == 1


def _claim_and_keep(directory: str, claimed: Event, done: Event) -> None:
    """A worker whose claim frees nothing: it claims the whole shortfall, then keeps its seats (as one
    whose yielder died between its claim and its stop)."""
    lease = gpu_lease.acquire(SEATS - POOL.world_size, ["0"], seats=SEATS, directory=directory, timeout=WAIT_S)
    if _until(lambda: seat_want.seats_wanted(directory) > 0):
        if seat_want.claim_seats(seat_want.seats_wanted(directory), directory) is not None:
            claimed.set()
    done.wait(WAIT_S)
    lease.release()


def test_a_waiter_asks_again_when_a_claim_frees_nothing(tmp_path, monkeypatch):
    directory = str(tmp_path)
    monkeypatch.setattr(seat_want, "REARM_S", 0.5)  # the waiter's own bound, short here
    workers = Workers(directory, ["0"], SEATS)
    claimed = workers.ctx.Event()
    keeper = workers.ctx.Process(target=_claim_and_keep, args=(directory, claimed, workers.done))
    try:
        workers.add([POOL], yield_when=lambda: claimed.wait(WAIT_S))  # yields once the keeper has claimed
        keeper.start()
        assert _until(lambda: workers.free() == [0])  # the keeper took the rest of the GPU
        lease = gpu_lease.acquire(1, ["0"], seats=SEATS, directory=directory, timeout=SERVED_S)
        lease.release()
        assert claimed.is_set() and lease.waited_s >= 0.5  # served once it asked again
        assert workers.seats_given_up() == [POOL.world_size]
    finally:
        workers.stop()
        keeper.join(timeout=WAIT_S)
        if keeper.is_alive():
            keeper.kill()
