"""The GPU job's sharing of its GPUs, without a GPU: simulated xdist workers (real processes) take cases
one at a time from a shared queue, as xdist's load scheduling hands them out, and run each on the pools
of the real registry (get_pool, release_gpu_pools), whose RankPools take their seats through
the real lease, and whose yielder thread gives idle pools' seats to a process that waits; only the rank
processes are simulated. For 1, 2, 4 and 8 GPUs with K seats per GPU: every case is
placed, no seat is held twice (no GPU carries more than K ranks), an NCCL pool's ranks are on distinct
GPUs, a worker's pools are reused across world sizes when K allows, a SIGKILLed worker stalls nobody,
and the checks fail when the lock does nothing."""

from __future__ import annotations

import fcntl
import math
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection, wait

import pytest

from qgather.model.case import CaseSpec
from qgather.pytest_plugin.gpu_schedule import GIB, plan_seats
from qgather.runtime import gpu_lease, pool, registry, seat_want, spec
from qgather.runtime.pool import RankPool
from qgather.runtime.spec import PoolSpec

WORKERS = 4
WAIT_S = 60.0  # bounds every wait of the simulation: a deadlock fails the test instead of hanging it
HOLD_S = 0.003  # a case's time on its pool
SIZES = (1, 2, 3, 4, 8)


def collection() -> list[str]:
    ids = [f"reference:fp8_tensor:{rows}x64:bf16:ws{ws}:gather:s0" for rows in range(8, 16) for ws in SIZES]
    ids += [f"te:fp8_block:128x128:bf16:ws{ws}:steps:s0:dcp-ws{saved}" for ws, saved in ((2, 4), (4, 1), (3, 2))]
    return ids


class SimPool(RankPool):
    """A RankPool whose ranks are simulated: its seats are real (the lease), and so are its checks."""

    marks: str = ""  # the folder of the seat markers

    def _spawn(self) -> None:
        lease = self._lease
        assert lease is not None
        assert len(set(lease.gpus)) == len(gpu_lease.ranks_per_gpu(self.spec.world_size, len(pool.visible_gpus())))
        self._markers = []
        for gpu, seat in lease.seats:
            path = os.path.join(self.marks, f"{gpu}-{seat}")
            if not _claim(path):
                self._teardown()
                raise AssertionError(f"seat {seat} of GPU {gpu} held twice")
            self._markers.append(path)
        self._ranks = [None] * self.spec.world_size  # type: ignore[list-item]
        self.spawn_count += 1

    def _collect(self, replies, deadline):  # the simulated ranks joined at once
        replies.pending.clear()
        return replies

    def _run(self, *_args, **_kwargs) -> object:  # RankPool.run holds in_use around it
        if not self._ranks:
            failure = self.start()
            if failure is not None:
                raise AssertionError(failure.headline())
        time.sleep(HOLD_S)  # the case's work on the GPUs, while the other workers run theirs
        return None

    def shutdown(self) -> None:
        self._teardown()

    def _teardown(self) -> None:
        for path in getattr(self, "_markers", []):
            os.remove(path)
        self._markers = []
        self._ranks = []
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def _claim(path: str) -> bool:
    """Create the seat's marker with this pid in it; False while a live process holds it (a SIGKILLed
    holder's marker is stale: its seat is free again)."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _alive(_holder(path)):
                return False
            os.remove(path)
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def _holder(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pool_specs(case: CaseSpec, gpus: int) -> list[PoolSpec]:
    return [PoolSpec("nccl" if size <= gpus else "gloo", size, "cuda") for size in case.pool_sizes]


def _worker(name: str, gpus: int, marks: str, conn: Connection, broken_lock: bool) -> None:
    """A simulated xdist worker: runs the case ids it is sent on the registry's pools until it gets None."""
    names = [str(i) for i in range(gpus)]
    spec.visible_gpus = pool.visible_gpus = lambda: names  # what this simulated host has
    registry.RankPool = SimPool
    registry._pools.clear()  # forked: the parent's pools (earlier tests') are the parent's, not this worker's
    SimPool.marks = marks
    if broken_lock:
        fcntl.flock = lambda fd, op: None
    try:
        while (case_id := conn.recv()) is not None:
            for pool_spec in _pool_specs(CaseSpec.parse(case_id), gpus):
                registry.get_pool(pool_spec).run(None)
            conn.send((case_id, sum(p.spawn_count for p in registry._pools.values()), ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("", 0, repr(exc)))
    finally:
        registry.shutdown_pools(keep_helpers=True)


class Controller:
    """xdist's controller, simplified: a pipe per worker, the next case to whichever finished one, a
    SIGKILLed worker's case handed to another."""

    def __init__(self, workers: dict[str, tuple[mp.Process, Connection]]) -> None:
        self.workers = workers
        self.pending = collection()
        self.running: dict[str, str] = {}
        self.placed: dict[str, str] = {}
        self.errors: list[str] = []
        self.starts: dict[str, int] = {}

    def run(self, kill_one: bool) -> None:
        for name in self.workers:
            self._hand_out(name)
        total, killed = len(self.pending) + len(self.running), None
        while len(self.placed) < total and not self.errors:
            live = {conn: name for name, (_, conn) in self.workers.items() if name != killed}
            ready = wait(list(live), timeout=WAIT_S)
            if not ready:
                raise AssertionError(f"no case finished in {WAIT_S} s: the workers deadlocked "
                                     f"({len(self.placed)} of {total} placed)")
            for conn in ready:
                self._receive(live[conn])
            if kill_one and killed is None and len(self.placed) >= total // 3 and self.running:
                killed = next(iter(self.running))  # SIGKILLed in the middle of a case, holding its pools' seats
                process = self.workers[killed][0]
                os.kill(process.pid, signal.SIGKILL)
                process.join(timeout=WAIT_S)
                self.pending.append(self.running.pop(killed))  # the next worker to finish one takes it

    def _receive(self, name: str) -> None:
        case_id, starts, error = self.workers[name][1].recv()
        if error:
            self.errors.append(f"{name}: {error}")
            return
        self.placed[case_id] = name
        self.starts[name] = starts
        del self.running[name]
        self._hand_out(name)

    def _hand_out(self, name: str) -> None:
        if self.pending:
            self.running[name] = self.pending.pop(0)
            self.workers[name][1].send(self.running[name])

    def stop(self) -> None:
        for process, conn in self.workers.values():
            if process.is_alive():
                conn.send(None)
        for process, _ in self.workers.values():
            process.join(timeout=WAIT_S)
            if process.is_alive():
                process.kill()


def simulate(tmp_path, gpus: int, seats: int, *, kill_one: bool = False, broken_lock: bool = False) -> Controller:
    """Run the collection on WORKERS simulated workers; the controller says where each case ran."""
    ctx = mp.get_context("fork")
    lease_dir, marks = tmp_path / "lease", tmp_path / "marks"
    lease_dir.mkdir()
    marks.mkdir()
    os.environ[gpu_lease.LEASE_DIR_ENV] = str(lease_dir)
    os.environ[gpu_lease.SEATS_ENV] = str(seats)
    workers = {}
    for i in range(WORKERS):
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_worker, args=(f"gw{i}", gpus, str(marks), theirs, broken_lock))
        process.start()
        workers[f"gw{i}"] = (process, ours)
    controller = Controller(workers)
    try:
        controller.run(kill_one)
    finally:
        controller.stop()
        del os.environ[gpu_lease.LEASE_DIR_ENV], os.environ[gpu_lease.SEATS_ENV]
    live = [p.name for p in marks.iterdir() if _alive(_holder(str(p)))]
    assert not live, f"seats {live} still marked after every worker stopped"
    return controller


def _fewest_seats(gpus: int) -> int:
    return math.ceil(max(SIZES) / gpus)  # the widest pool's ranks on one GPU


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_every_case_is_placed_on_at_most_k_ranks_per_gpu(tmp_path, gpus):
    run = simulate(tmp_path, gpus, _fewest_seats(gpus))
    assert run.errors == []
    assert sorted(run.placed) == sorted(collection())


@pytest.mark.parametrize("gpus", [2, 4])
def test_a_workers_pools_stay_warm_across_world_sizes_when_k_allows(tmp_path, gpus):
    roomy = WORKERS * sum(math.ceil(size / gpus) for size in SIZES)  # every worker keeps every pool
    run = simulate(tmp_path, gpus, roomy)
    assert run.errors == [] and sorted(run.placed) == sorted(collection())
    specs = {s for case_id in collection() for s in _pool_specs(CaseSpec.parse(case_id), gpus)}
    assert max(run.starts.values()) <= len(specs), f"pools restarted: {run.starts} for {len(specs)} pool kinds"


@pytest.mark.parametrize("gpus", [2, 4])
def test_a_sigkilled_worker_stalls_nobody(tmp_path, gpus):
    run = simulate(tmp_path, gpus, _fewest_seats(gpus), kill_one=True)
    assert run.errors == []
    assert sorted(run.placed) == sorted(collection())


def test_the_checks_fail_when_the_lock_does_nothing(tmp_path):
    run = simulate(tmp_path, 2, _fewest_seats(2), broken_lock=True)
    assert any("held twice" in error for error in run.errors), run.errors


def test_k_is_what_the_tightest_gpu_and_the_host_can_carry():
    per_rank = plan_seats([80 * GIB], 1024 * GIB).per_rank_bytes
    by_gpu = plan_seats([141 * GIB, 40 * GIB], 1024 * GIB)  # the tightest GPU decides
    assert by_gpu.seats == int(0.8 * 40 * GIB) // per_rank
    by_host = plan_seats([141 * GIB, 141 * GIB], 32 * GIB)  # 32 GiB over 2 GPUs at 1 GiB a rank
    assert by_host.seats == int(0.8 * 32 * GIB) // (2 * GIB)
    assert plan_seats([1 * GIB], 1 * GIB).seats == 1  # never none
    assert "tightest GPU 40.0 GiB free" in by_gpu.describe()


class IdlePool(RankPool):
    """A started pool whose ranks are not there: what release_gpu_pools stops is recorded, nothing else."""

    stopped: list[int]

    @property
    def started(self) -> bool:
        return True

    def shutdown(self) -> None:
        IdlePool.stopped.append(self.spec.world_size)


def test_a_process_gives_its_standby_pools_up_before_a_pool_it_uses(monkeypatch):
    """A standby is a spare: the yielder and a process about to wait for seats stop it first, even when a
    pool in use is wider (widest first within each)."""
    monkeypatch.setattr(spec, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(registry, "_pools", {})
    monkeypatch.setattr(registry, "_standby", {})
    IdlePool.stopped = []
    for size in (8, 4):
        registry._pools[PoolSpec("gloo", size, "cuda")] = IdlePool(PoolSpec("gloo", size, "cuda"))
    for size in (2, 1):
        registry._standby[PoolSpec("nccl", size, "cuda")] = IdlePool(PoolSpec("nccl", size, "cuda"))
    monkeypatch.setattr(registry, "claim_seats", lambda seats: seat_want.Claim("", 0, seats))  # seats missing
    assert registry.yield_seats_wanted() and IdlePool.stopped == [2]
    assert registry.release_gpu_pools() == 4 and IdlePool.stopped == [2, 2, 1, 8, 4]


def test_no_standby_starts_while_another_process_waits_for_seats(monkeypatch):
    monkeypatch.setattr(spec, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(registry, "_standby", {})
    monkeypatch.delenv(registry.STANDBY_ENV, raising=False)
    restarted = IdlePool(PoolSpec("gloo", 4, "cuda"))
    restarted.spawn_count = 2  # restarted once: it would get a standby
    monkeypatch.setattr(registry, "someone_waits", lambda: True)
    assert registry._standby_for(restarted.spec, restarted) is restarted and not registry._standby
    monkeypatch.setattr(registry, "someone_waits", lambda: False)
    monkeypatch.setattr(RankPool, "start_in_background", lambda self: None)
    assert registry._standby_for(restarted.spec, restarted) is restarted and restarted.spec in registry._standby


def test_the_seat_plan_closes_a_quiet_run_whose_header_pytest_did_not_show():
    from qgather.pytest_plugin import gpu_schedule, session

    class Terminal:
        def __init__(self, verbosity: int) -> None:
            self.verbosity, self.lines = verbosity, []

        def write_line(self, line: str) -> None:
            self.lines.append(line)

    config = type("Config", (), {"stash": {gpu_schedule.seat_plan_key: plan_seats([139 * GIB], 120 * GIB)}})()
    quiet, verbose = Terminal(-1), Terminal(0)
    session.pytest_terminal_summary(quiet, config)
    session.pytest_terminal_summary(verbose, config)  # pytest's header said it already
    assert quiet.lines == [f"qgather: {config.stash[gpu_schedule.seat_plan_key].describe()}"]
    assert quiet.lines[0].startswith("qgather: GPU seats: 84 per GPU (tightest GPU 139.0 GiB free")
    assert verbose.lines == []


def test_a_gpu_jobs_worker_launches_its_forkserver_with_the_compile_warm_up_before_it_collects(monkeypatch):
    from qgather.pytest_plugin import gpu_schedule
    from qgather.pytest_plugin.collection import preload_before_key
    from qgather.runtime import gpu_lease
    from qgather.runtime.helpers import COMPILE_WARMUP, PRELOAD_ENV

    launched = []
    monkeypatch.setattr(gpu_schedule, "mp_context", lambda: launched.append(os.environ.get(PRELOAD_ENV)))
    monkeypatch.setenv(PRELOAD_ENV, "transformer_engine.pytorch")
    monkeypatch.delenv(gpu_lease.LEASE_DIR_ENV, raising=False)
    cpu = type("Config", (), {"stash": {}})()
    gpu_schedule.boot_forkserver_early(cpu)  # not a GPU job: its pools start as before
    assert launched == [] and cpu.stash == {}
    monkeypatch.setenv(gpu_lease.LEASE_DIR_ENV, "/tmp/qgather-pool-x")
    gpu = type("Config", (), {"stash": {}})()
    gpu_schedule.boot_forkserver_early(gpu)
    assert launched == [f"transformer_engine.pytorch,{COMPILE_WARMUP}"]  # the preloads read at the launch
    assert gpu.stash[preload_before_key] == "transformer_engine.pytorch"  # what pytest_unconfigure restores
    gpu_schedule.boot_forkserver_early(gpu)
    assert len(launched) == 1  # once
