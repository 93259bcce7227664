"""The GPU job's scheduling without a GPU: qgather's xdist scheduler (GpuScheduling) hands a synthetic
collection to simulated workers, threads that lease simulated GPUs through the real lease module and
follow the worker rules of qgather.pytest_plugin.gpu_schedule. For 1, 2, 4 and 8 GPUs: every case is
run, no GPU is leased by two live pools, the GPUs are all in use at some point, pools stay warm across
a unit, and a pool that dies mid-run (its GPUs given back at once) stalls nobody."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest

from qgather.pytest_plugin.collection import case_in
from qgather.pytest_plugin.gpu_schedule import CHUNK, FREE, gpu_need, unit_needs
from qgather.pytest_plugin.gpu_scheduler import GpuScheduling
from qgather.runtime import gpu_lease

WORKERS = 6
WAIT_S = 60.0  # bounds every wait of the simulation: a deadlock fails the test instead of hanging it


def collection() -> list[str]:
    ids = [f"reference:fp8_tensor:{rows}x64:bf16:ws{ws}:gather:s0" for ws in (1, 2, 3, 4, 8) for rows in range(8, 88)]
    ids += [f"te:fp8_block:128x128:bf16:ws{ws}:steps:s0:dcp-ws{saved}" for ws, saved in ((2, 4), (4, 1), (3, 2))]
    ids += ["reference:nvfp4_2d:64x64:bf16:ws16:virtual:s0"]
    random.Random(0).shuffle(ids)
    nodes = [f"cases/test_alignment.py::test_alignment[{case_id}]" for case_id in ids]
    return nodes + [f"tests/gpu/test_te_quantizers.py::test_bits[{n}]" for n in range(20)]


class Node:
    """What the scheduler sees of an xdist worker."""

    def __init__(self, name: str, cond: threading.Condition) -> None:
        self.name = name
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.shutting_down = False
        self._cond = cond

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.queue.extend(indexes)
        self._cond.notify_all()

    def shutdown(self) -> None:
        self.shutting_down = True
        self._cond.notify_all()

    def __repr__(self) -> str:
        return self.name


class Host:
    """The simulated GPUs: who holds each slot (checked on every lease), and how busy they got."""

    def __init__(self, gpus: int) -> None:
        self.gpus = [str(i) for i in range(gpus)]
        self.owner: dict[int, str] = {}
        self.most_in_use = 0
        self.leases = 0
        self.lock = threading.Lock()

    def took(self, who: str, lease: gpu_lease.Lease) -> None:
        with self.lock:
            shared = [s for s in lease.slots if s in self.owner]
            assert not shared, f"{who} leased slots {shared} held by {[self.owner[s] for s in shared]}"
            self.owner.update({s: who for s in lease.slots})
            self.most_in_use = max(self.most_in_use, len(self.owner))
            self.leases += 1

    def gave_back(self, lease: gpu_lease.Lease) -> None:
        with self.lock:
            for s in lease.slots:
                del self.owner[s]
        lease.release()


def run_worker(node: Node, sched: GpuScheduling, cond: threading.Condition, host: Host, directory: str,
               nodeids: list[str], deaths: float, errors: list[str]) -> None:
    rng = random.Random(node.name)
    pools: dict[int, gpu_lease.Lease] = {}

    def release(keep: set[int]) -> None:  # registry.release_gpu_pools
        for size in [s for s in pools if s not in keep]:
            host.gave_back(pools.pop(size))

    try:
        while True:
            with cond:  # xdist runs an item once it has the next one, or is told to shut down
                if not cond.wait_for(lambda: len(node.queue) >= 2 or node.shutting_down, timeout=WAIT_S):
                    raise AssertionError(f"{node} waited {WAIT_S} s for work")
                if not node.queue:
                    return
                index = node.queue.pop(0)
                following = node.queue[0] if node.queue else None
            for size in sizes_of(nodeids[index], len(host.gpus)):
                if size not in pools:
                    pools[size] = gpu_lease.acquire(size, host.gpus, directory=directory, timeout=WAIT_S,
                                                    before_wait=lambda keep={size}: release(keep))
                    host.took(node.name, pools[size])
            if pools and rng.random() < deaths:  # the pool died: its ranks are gone, so is its lease
                release(set())
            with cond:
                sched.mark_test_complete(node, index)
            release(set(sizes_of(nodeids[following], len(host.gpus))) if following is not None else set())
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        errors.append(f"{node}: {exc!r}")
    finally:
        release(set())


def sizes_of(nodeid: str, gpus: int) -> list[int]:
    case = case_in(nodeid)
    return [s for s in case.pool_sizes if s <= gpus] if case else []


def simulate(gpus: int, directory: str, deaths: float = 0.0) -> tuple[Host, list[Node], list[str]]:
    cond = threading.Condition()
    nodeids = collection()
    config = SimpleNamespace(getvalue=lambda name: [f"{WORKERS}*popen"], option=SimpleNamespace(loadscopereorder=False))
    sched = GpuScheduling(config, None, gpus)
    nodes = [Node(f"gw{i}", cond) for i in range(WORKERS)]
    with cond:
        for node in nodes:
            sched.add_node(node)
        for node in nodes:
            sched.add_node_collection(node, nodeids)
        sched.schedule()
    host, errors = Host(gpus), []
    threads = [threading.Thread(target=run_worker, args=(n, sched, cond, host, directory, nodeids, deaths, errors))
               for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * WAIT_S)
    assert not any(t.is_alive() for t in threads), "a simulated worker is stuck: the scheduling deadlocked"
    with cond:
        assert sched.tests_finished and not sched.has_pending, "cases left unrun"
    return host, nodes, errors


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_every_case_runs_and_no_gpu_is_leased_twice(tmp_path, gpus):
    host, _, errors = simulate(gpus, str(tmp_path))
    assert errors == []
    assert host.most_in_use == gpus, "the GPUs were never all in use at once"
    gpu_units = {unit for unit, need in unit_needs(collection(), gpus).values() if need != FREE}
    # a worker keeps its pool warm within a unit, and takes a unit of the size it ran last while one is left
    assert host.leases <= len(gpu_units), f"{host.leases} pool starts for {len(gpu_units)} units: pools not kept warm"


@pytest.mark.parametrize("gpus", [2, 4])
def test_pools_that_die_stall_nobody(tmp_path, gpus):
    host, _, errors = simulate(gpus, str(tmp_path), deaths=0.2)
    assert errors == []
    assert host.owner == {}


def test_units_hold_cases_of_one_gpu_need_in_collection_order():
    nodeids = collection()
    units = unit_needs(nodeids, 4)
    members: dict[str, list[str]] = {}
    for nodeid in nodeids:
        members.setdefault(units[nodeid][0], []).append(nodeid)
    for unit, nodes in members.items():
        needs = {gpu_need(case_in(n), 4) if case_in(n) else FREE for n in nodes}
        assert len(needs) == 1 and len(nodes) <= CHUNK, unit
    assert units[nodeids[-1]][1] == FREE  # not a case
    ws8 = next(n for n in nodeids if ":ws8:" in n)
    assert units[ws8][1] == FREE  # more ranks than GPUs: gloo on CUDA, no lease
    saved = next(n for n in nodeids if "ws4:steps:s0:dcp-ws1" in n)
    assert units[saved][1] == 4
