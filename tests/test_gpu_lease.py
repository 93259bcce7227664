"""GPU leases (qgather.runtime.gpu_lease) between real processes, on simulated GPU counts: a slot is
never held by two processes at once, every acquisition is served, a killed holder's GPUs come free,
and a wait that cannot be served ends at its bound with the holder named."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal

import pytest

from qgather.runtime import gpu_lease

WORKERS = 5
ACQUISITIONS = 12


def _hold_markers(directory: str, slots: tuple[int, ...]) -> list[str]:
    """Claim an O_EXCL marker per slot: a second live holder of a slot fails to create it."""
    made = []
    for slot in slots:
        path = os.path.join(directory, f"held{slot}")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            raise AssertionError(f"slot {slot} held twice") from None
        made.append(path)
    return made


def _worker(directory: str, gpus: list[str], seed: int, done: mp.Queue) -> None:
    rng = random.Random(seed)
    served = 0
    try:
        for _ in range(ACQUISITIONS):
            lease = gpu_lease.acquire(rng.randint(1, len(gpus)), gpus, directory=directory, timeout=60)
            markers = _hold_markers(directory, lease.slots)
            assert list(lease.gpus) == [gpus[i] for i in lease.slots]
            for _ in range(rng.randint(0, 2000)):  # some work while holding
                pass
            for path in markers:
                os.remove(path)
            lease.release()
            served += 1
        done.put((seed, served, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        done.put((seed, served, repr(exc)))


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_no_gpu_is_held_twice_and_every_acquisition_is_served(tmp_path, count):
    gpus = [str(i) for i in range(count)]
    ctx = mp.get_context("fork")
    done = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(str(tmp_path), gpus, seed, done)) for seed in range(WORKERS)]
    for w in workers:
        w.start()
    results = [done.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    assert [r for r in results if r[2]] == []
    assert sorted(served for _, served, _ in results) == [ACQUISITIONS] * WORKERS


def _hold_all_then_wait(directory: str, gpus: list[str], ready: mp.Event) -> None:
    gpu_lease.acquire(len(gpus), gpus, directory=directory, timeout=30)
    ready.set()
    signal.pause()  # until the test kills it


def test_a_killed_holders_gpus_come_free(tmp_path):
    gpus = ["0", "1", "2", "3"]
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_all_then_wait, args=(str(tmp_path), gpus, ready))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(gpu_lease.LeaseTimeout, match=f"slot 0 held by pid {holder.pid}"):
            gpu_lease.acquire(1, gpus, directory=str(tmp_path), timeout=0.3)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(timeout=30)
        lease = gpu_lease.acquire(4, gpus, directory=str(tmp_path), timeout=30)
        assert lease.slots == (0, 1, 2, 3)
        lease.release()
    finally:
        if holder.is_alive():
            holder.kill()


def test_before_wait_runs_only_when_the_gpus_are_taken(tmp_path):
    gpus = ["4", "6"]  # the caller's CUDA_VISIBLE_DEVICES entries, not physical ids
    calls = []
    first = gpu_lease.acquire(1, gpus, directory=str(tmp_path), before_wait=lambda: calls.append("first"))
    assert calls == [] and first.gpus == ("4",)

    def free_the_first() -> None:  # what the registry does: stop this process's other GPU pools
        calls.append("second")
        first.release()

    second = gpu_lease.acquire(2, gpus, directory=str(tmp_path), timeout=10, before_wait=free_the_first)
    assert calls == ["second"] and second.gpus == ("4", "6")
    second.release()
    second.release()  # idempotent
    assert not second.held


def test_more_gpus_than_the_host_has_is_a_usage_error(tmp_path):
    with pytest.raises(ValueError, match="cannot lease 3 of 2"):
        gpu_lease.acquire(3, ["0", "1"], directory=str(tmp_path))
