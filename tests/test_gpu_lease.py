"""GPU seats (qgather.runtime.gpu_lease) between real processes, on simulated GPUs: no seat is held by
two processes at once (so no GPU carries more than K ranks), the ranks of one NCCL pool are on distinct
GPUs, every acquisition is served, a SIGKILLed holder's seats come free, a wait that cannot be served
ends at its bound with the holders named, and the checks fail when the lock does nothing."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import random
import signal
import time

import pytest

from qgather.runtime import gpu_lease, seat_want

WORKERS = 5
ROUNDS = 8
HOLD_S = (0.002, 0.02)  # how long a worker keeps its seats: long enough for the others to want them


def _mark(directory: str, lease: gpu_lease.Lease) -> list[str]:
    """An O_EXCL marker per held seat: a second live holder of one seat fails to create it."""
    made = []
    for gpu, seat in lease.seats:
        path = os.path.join(directory, f"held-{gpu}-{seat}")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            raise AssertionError(f"seat {seat} of GPU {gpu} held twice") from None
        made.append(path)
    return made


def _check_placement(lease: gpu_lease.Lease, world_size: int, gpus: list[str], seats: int) -> None:
    expected = gpu_lease.ranks_per_gpu(world_size, len(gpus))
    assert len(lease.gpus) == len(set(lease.gpus)) == len(expected), lease
    per_gpu: dict[int, int] = {}
    for gpu, _ in lease.seats:
        per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    assert sorted(per_gpu.values(), reverse=True) == expected, lease
    assert all(seat < seats for _, seat in lease.seats)
    assert sorted(lease.gpus) == sorted(gpus[i] for i in per_gpu)


def _worker(directory: str, gpus: list[str], seats: int, seed: int, start: mp.Barrier, done: mp.Queue,
            broken_lock: bool) -> None:
    if broken_lock:
        fcntl.flock = lambda fd, op: None  # the lock that does nothing
    rng = random.Random(seed)
    served = 0
    try:
        start.wait(60)
        for _ in range(ROUNDS):
            world_size = rng.randint(1, len(gpus) * seats)
            lease = gpu_lease.acquire(world_size, gpus, seats=seats, directory=directory, timeout=60)
            markers = _mark(directory, lease)
            _check_placement(lease, world_size, gpus, seats)
            time.sleep(rng.uniform(*HOLD_S))  # the pool's work, while the others try for seats
            for path in markers:
                os.remove(path)
            lease.release()
            served += 1
        done.put((seed, served, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        done.put((seed, served, repr(exc)))


def _contend(directory: str, gpus: int, seats: int, broken_lock: bool = False) -> list[tuple[int, int, str]]:
    ctx = mp.get_context("fork")
    done, start = ctx.Queue(), ctx.Barrier(WORKERS)
    names = [str(i) for i in range(gpus)]
    workers = [ctx.Process(target=_worker, args=(directory, names, seats, seed, start, done, broken_lock))
               for seed in range(WORKERS)]
    for w in workers:
        w.start()
    results = [done.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    return results


@pytest.mark.parametrize(("gpus", "seats"), [(1, 1), (1, 3), (2, 2), (4, 1), (4, 3), (8, 2)])
def test_no_seat_is_held_twice_and_every_acquisition_is_served(tmp_path, gpus, seats):
    results = _contend(str(tmp_path), gpus, seats)
    assert [r for r in results if r[2]] == []
    assert sorted(served for _, served, _ in results) == [ROUNDS] * WORKERS


def test_the_checks_fail_when_the_lock_does_nothing(tmp_path):
    results = _contend(str(tmp_path), 2, 2, broken_lock=True)
    assert any("held twice" in error for _, _, error in results), results


def _hold_then_pause(directory: str, world_size: int, gpus: list[str], seats: int, ready: mp.Event) -> None:
    gpu_lease.acquire(world_size, gpus, seats=seats, directory=directory, timeout=30)
    ready.set()
    signal.pause()  # until the test kills it


def test_a_sigkilled_holders_seats_come_free(tmp_path):
    gpus = ["0", "1", "2", "3"]
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_then_pause, args=(str(tmp_path), 8, gpus, 2, ready))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(gpu_lease.LeaseTimeout, match=f"GPU 0: 2 of 2 seats held by pid\\(s\\) {holder.pid}"):
            gpu_lease.acquire(1, gpus, seats=2, directory=str(tmp_path), timeout=0.3)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(timeout=30)
        lease = gpu_lease.acquire(8, gpus, seats=2, directory=str(tmp_path), timeout=30)
        assert len(lease.seats) == 8
        lease.release()
    finally:
        if holder.is_alive():
            holder.kill()


def test_a_pool_takes_the_gpus_with_the_most_free_seats(tmp_path):
    gpus = ["4", "6", "7"]  # the caller's CUDA_VISIBLE_DEVICES entries, not physical ids
    first = gpu_lease.acquire(1, gpus, seats=2, directory=str(tmp_path))
    second = gpu_lease.acquire(2, gpus, seats=2, directory=str(tmp_path))
    assert first.gpus == ("4",) and second.gpus == ("6", "7")  # the emptiest first, then by index
    third = gpu_lease.acquire(3, gpus, seats=2, directory=str(tmp_path))
    assert set(third.gpus) == {"4", "6", "7"}
    for lease in (first, second, third):
        lease.release()


def test_before_wait_runs_and_want_is_raised_only_when_seats_are_short(tmp_path):
    directory = str(tmp_path)
    calls = []
    first = gpu_lease.acquire(2, ["0", "1"], seats=1, directory=directory, before_wait=lambda: calls.append(1))
    assert calls == [] and not seat_want.someone_waits(directory)

    def free_the_first() -> None:  # what the registry does: stop this process's idle GPU pools
        calls.append(2)
        assert seat_want.someone_waits(directory) is False  # raised only after before_wait freed nothing
        first.release()

    second = gpu_lease.acquire(1, ["0", "1"], seats=1, directory=directory, timeout=10, before_wait=free_the_first)
    assert calls == [2] and second.gpus == ("0",)
    assert not seat_want.someone_waits(directory)  # lowered once served
    second.release()
    second.release()  # idempotent
    assert not second.held


def test_a_waiter_raises_want_for_the_others(tmp_path, monkeypatch):
    directory = str(tmp_path)
    held = gpu_lease.acquire(1, ["0"], seats=1, directory=directory)
    seen = []
    monkeypatch.setattr(gpu_lease.time, "sleep", lambda _: seen.append(seat_want.someone_waits(directory)))
    with pytest.raises(gpu_lease.LeaseTimeout):
        gpu_lease.acquire(1, ["0"], seats=1, directory=directory, timeout=0.5)
    assert seen and all(seen)  # up while it waited
    assert not seat_want.someone_waits(directory)  # down once it gave up
    held.release()


def test_the_flag_of_a_waiter_that_died_is_stale(tmp_path):
    ctx = mp.get_context("fork")
    dead = ctx.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join(timeout=30)
    stale = seat_want.Want(dead.pid, 2).text()
    for reader in (seat_want.someone_waits, seat_want.seats_wanted):
        (tmp_path / seat_want.WANT).write_text(stale)
        assert not reader(str(tmp_path))
        assert not (tmp_path / seat_want.WANT).exists()
    (tmp_path / seat_want.WANT).write_text(stale)
    assert seat_want.claim_seats(1, str(tmp_path)) is None  # no yielder stops a pool for a dead waiter
    (tmp_path / seat_want.WANT).write_text(seat_want.Want(os.getpid(), 2).text())
    assert seat_want.someone_waits(str(tmp_path)) and seat_want.seats_wanted(str(tmp_path)) == 2


@pytest.mark.parametrize(("world_size", "gpus", "expected"),
                         [(1, 4, [1]), (3, 4, [1, 1, 1]), (4, 4, [1] * 4), (8, 2, [4, 4]), (3, 2, [2, 1]),
                          (8, 3, [3, 3, 2])])
def test_ranks_per_gpu(world_size, gpus, expected):
    assert gpu_lease.ranks_per_gpu(world_size, gpus) == expected


def test_a_pool_that_could_never_be_seated_is_refused(tmp_path):
    with pytest.raises(ValueError, match="8 ranks on 2 GPU\\(s\\) need 4 seats of one GPU, which has 3"):
        gpu_lease.acquire(8, ["0", "1"], seats=3, directory=str(tmp_path))


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_seat_count_says_what_was_set(monkeypatch, value):
    monkeypatch.setenv(gpu_lease.SEATS_ENV, value)
    with pytest.raises(gpu_lease.SeatsError, match=f"QGATHER_GPU_SEATS='{value}'"):
        gpu_lease.seats_per_gpu()
