"""The GPU job's xdist scheduling (qgather.pytest_plugin.affinity), driven as xdist's DSession drives a
scheduler: workers report their collections, the scheduler sends them cases, they complete them one at
a time in a random interleaving, and a worker may die with cases pending. Every case runs exactly
once, a worker is only ever sent cases of one world size at a time, and a run starts at most 55% of the
pools that xdist's own scheduling, driven the same way, starts (one per worker and world size)."""

from __future__ import annotations

import random

import pytest
from xdist.scheduler import LoadScheduling

from qgather.pytest_plugin.affinity import (
    CHECKPOINT,
    NO_POOL,
    WorldSizeScheduling,
    busiest,
    key_of,
    pool_sizes_of,
    world_size_of,
)

WORKERS = 8
SIZES = (1, 2, 3, 4, 8)


class FakeConfig:
    def __init__(self, workers: int) -> None:
        self.workers = workers

    def getvalue(self, name: str) -> object:
        assert name == "tx"
        return [f"{self.workers}*popen"]

    def getoption(self, name: str, default: object = None) -> object:
        return {"maxschedchunk": None, "dist": "load"}.get(name, default)


class FakeNode:
    """A worker: the cases it was sent, in order, and the world sizes it started pools for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down = False
        self.queue: list[int] = []
        self.ran: list[int] = []
        self.pools: set[int] = set()
        self.sizes_sent: list[set[int]] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def gate_collection() -> list[str]:
    """A GPU gate's shape: world size varies fastest, with a few items that name no world size."""
    ids = [f"cases/test_alignment.py::test_gather[te:fp8_tensor:{rows}x64:bf16:ws{ws}:gather:s0]"
           for rows in range(1, 120) for ws in SIZES]
    ids += [f"cases/test_checkpoint_compile.py::test_dcp[te:fp8_tensor:{rows}x64:bf16:ws{ws}:gather:s0:dcp-ws{saved}]"
            for rows in range(1, 2) for ws in SIZES for saved in SIZES]  # ~4% of the ids, as in the gate
    ids += [f"tests/gpu/test_te.py::test_cross_check[{n}]" for n in range(20)]
    return ids


def pools_of(nodeid: str) -> set[int]:
    """The world sizes of the pools an item runs on: its own, and a dcp-wsA case's save at A."""
    return set(pool_sizes_of(nodeid))


def drive(scheduler: LoadScheduling, nodes: list[FakeNode], collection: list[str], seed: int,
          kill: FakeNode | None = None, duration: float = 0.0) -> list[int]:
    """Run every case as DSession would, each reported as taking `duration` seconds; `kill` dies
    (remove_node) after its fifth case. Returns the indices run, in completion order."""
    rng = random.Random(seed)
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    done: list[int] = []
    alive = list(nodes)
    for _ in range(10 * len(collection)):
        busy = [node for node in alive if node.queue]
        if not busy:
            break
        node = rng.choice(busy)
        if node is kill and len(node.ran) == 5:
            alive.remove(node)
            crashed = scheduler.remove_node(node)
            assert crashed is not None, "a worker that died with cases pending reports its current case"
            done.append(collection.index(crashed))  # xdist reports the crashed case as failed
            node.queue.clear()
            continue
        index = node.queue.pop(0)
        node.ran.append(index)
        node.pools |= pools_of(collection[index])
        done.append(index)
        scheduler.mark_test_complete(node, index, duration)
    assert scheduler.tests_finished or not scheduler.has_pending
    return done


def test_world_size_of_reads_the_case_id():
    assert world_size_of("cases/test_alignment.py::test_gather[reference:fp8_tensor:1x16:bf16:ws8:gather:s0]") == 8
    assert world_size_of("cases/test_x.py::test_y[te:fp8_block:2x16:bf16:ws2:steps:s0:dcp-ws4]") == 2
    assert world_size_of("cases/test_dispatch_ops.py::test_chunk[reference:fp8_tensor]") == NO_POOL
    assert key_of("cases/test_x.py::test_y[te:fp8_block:2x16:bf16:ws2:steps:s0:dcp-ws4]") == CHECKPOINT
    assert key_of("cases/test_x.py::test_y[te:fp8_block:2x16:bf16:ws2:steps:s0:raf-2]") == 2


def test_a_checkpoint_case_is_keyed_by_its_pools_whatever_its_configuration_joins():
    """The 1 x H200 gate's costliest pool starts were dcp-wsA cases whose configuration joins other
    options (tp-2x2+dcp-ws8, compile+dcp-ws4): keyed by their own size, the workers of that size
    started the saving sizes' pools too."""
    for config in ("tp-2x2+dcp-ws8", "compile+dcp-ws8", "mp-bf16+raf-no+dcp-ws8"):
        nodeid = f"cases/test_ckpt.py::test_config[reference:fp8_tensor:128x64:bf16:ws4:gather:s0:{config}]"
        assert pool_sizes_of(nodeid) == (4, 8)
        assert key_of(nodeid) == CHECKPOINT
    # saved at its own size: one pool, its size's
    assert key_of("cases/t.py::test_y[reference:fp8_tensor:128x64:bf16:ws2:gather:s0:compile+dcp-ws2]") == 2
    # a virtual case runs in the runner's process, on no pool
    assert key_of("cases/t.py::test_y[reference:fp8_tensor:128x64:bf16:ws2:virtual:s0]") == NO_POOL
    assert key_of("tests/gpu/test_te.py::test_cross_check[3]") == NO_POOL


def test_busiest_weighs_work_left_per_worker_already_there():
    left = {1: 100, 2: 100, 8: 10}
    assert busiest(_counter(left), _counter({})) == 2  # ws2's cases cost more than ws1's
    assert busiest(_counter(left), _counter({2: 1})) == 1  # one worker on ws2 already: ws1 has more per worker
    assert busiest(_counter({}), _counter({})) is None


def _counter(d: dict[int, int]):
    from collections import Counter
    return Counter(d)


@pytest.mark.parametrize("seed", range(6))
def test_every_case_runs_once_and_a_run_starts_half_the_pools_or_fewer(seed):
    collection = gate_collection()
    nodes = [FakeNode(f"gw{n}") for n in range(WORKERS)]
    done = drive(WorldSizeScheduling(FakeConfig(WORKERS)), nodes, collection, seed)
    assert sorted(done) == list(range(len(collection))), "a case ran twice or not at all"
    starts = sum(len(node.pools) for node in nodes)
    baseline = [FakeNode(f"gw{n}") for n in range(WORKERS)]
    drive(LoadScheduling(FakeConfig(WORKERS)), baseline, collection, seed)
    xdist_starts = sum(len(node.pools) for node in baseline)
    assert xdist_starts >= WORKERS * len(SIZES) - 4, "the simulation does not show xdist's pool per size"
    assert starts <= 0.55 * xdist_starts, f"{starts} pool starts for {WORKERS} workers (xdist's own: {xdist_starts})"
    print(f"pool starts: {starts} (xdist's own scheduling: {xdist_starts})")


def test_checkpoint_cases_kept_to_a_few_workers_start_fewer_pools(monkeypatch):
    """A dcp-wsA case runs on pools of two world sizes: keyed by its own size, every worker would start
    the saving sizes' pools too."""
    from qgather.pytest_plugin import affinity

    def starts(seed: int) -> int:
        nodes = [FakeNode(f"gw{n}") for n in range(WORKERS)]
        drive(WorldSizeScheduling(FakeConfig(WORKERS)), nodes, gate_collection(), seed)
        return sum(len(node.pools) for node in nodes)

    kept = [starts(seed) for seed in range(3)]
    monkeypatch.setattr(affinity, "key_of", affinity.world_size_of)
    spread = [starts(seed) for seed in range(3)]
    assert sum(kept) < sum(spread), (kept, spread)


def _record_batches(nodes: list[FakeNode], collection: list[str]) -> dict[str, list[list[int]]]:
    """Each node's batches as sent, as the keys of their items in order."""
    sent: dict[str, list[list[int]]] = {node.name: [] for node in nodes}
    for node in nodes:
        original = node.send_runtest_some

        def recording(indices, node=node, original=original):
            sent[node.name].append([key_of(collection[i]) for i in indices])
            original(indices)

        node.send_runtest_some = recording
    return sent


def test_a_worker_is_sent_one_world_size_at_a_time():
    """Past the no-pool items at the head of its first batch (test below), a batch is of one size."""
    collection = gate_collection()
    nodes = [FakeNode(f"gw{n}") for n in range(WORKERS)]
    sent = _record_batches(nodes, collection)
    drive(WorldSizeScheduling(FakeConfig(WORKERS)), nodes, collection, seed=7)
    for batches in sent.values():
        first, *later = batches
        assert len(set(first[_lead(first):])) == 1 and all(len(set(batch)) == 1 for batch in later), batches


def _lead(batch: list[int]) -> int:
    """How many no-pool items lead a batch that has cases of a size."""
    return 0 if set(batch) == {NO_POOL} else next(i for i, key in enumerate(batch) if key != NO_POOL)


def test_a_workers_first_batch_leads_with_its_share_of_the_no_pool_items():
    """They run while the worker's first pool starts in the background (qgather.pytest_plugin.lookahead)."""
    collection = gate_collection()
    no_pool = sum(key_of(nodeid) == NO_POOL for nodeid in collection)
    nodes = [FakeNode(f"gw{n}") for n in range(WORKERS)]
    sent = _record_batches(nodes, collection)
    done = drive(WorldSizeScheduling(FakeConfig(WORKERS)), nodes, collection, seed=3)
    assert sorted(done) == list(range(len(collection)))
    firsts = [batches[0] for batches in sent.values() if batches[0][-1] != NO_POOL]
    assert len(firsts) >= WORKERS - 1 and no_pool // WORKERS >= 2
    for first in firsts:
        assert _lead(first) == no_pool // WORKERS, first[:4]


def test_each_lead_takes_its_share_across_the_no_pool_items_not_a_run_of_one_kind():
    """The virtual cases come first in the collection and the GPU-only tests (~5x as long) last: a lead
    of the first no-pool items would give some workers only the quick ones."""
    virtual = [f"cases/test_virtual.py::test_virtual[reference:fp8_tensor:{rows}x64:bf16:ws2:virtual:s0]"
               for rows in range(1, 97)]
    assert {key_of(nodeid) for nodeid in virtual} == {NO_POOL}
    collection = virtual + gate_collection()  # its 20 GPU-only tests last
    nodes = [FakeNode(f"gw{n}") for n in range(WORKERS)]
    scheduler = WorldSizeScheduling(FakeConfig(WORKERS))
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()  # each worker's first batch, as xdist sends it
    for node in nodes:
        lead = node.queue[:_lead([key_of(collection[i]) for i in node.queue])]
        gpu_tests = sum(collection[i].startswith("tests/gpu/") for i in lead)
        # 20 of the 116 no-pool items: ~2 in a lead of 11 (half the first batch); 0 or all from a run of one kind
        assert len(lead) >= 8 and 1 <= gpu_tests <= 3, [collection[i] for i in lead]


@pytest.mark.parametrize("duration", [0.0, 0.3])
def test_a_worker_gets_its_next_world_size_while_its_last_cases_still_run(duration):
    """With tests of 0.1 s or more xdist refills a worker once it has one item left: its next size's
    first case then waited for the whole start of that size's pool (run V, 2 x H200)."""
    collection = gate_collection()
    nodes = [FakeNode(f"gw{n}") for n in range(WORKERS)]
    left_at_moves: list[int] = []
    for node in nodes:
        original, last = node.send_runtest_some, {}

        def recording(indices, node=node, original=original, last=last):
            sizes = {key_of(collection[i]) for i in indices} - {NO_POOL}
            if last.get("size") is not None and sizes and sizes != {last["size"]}:
                left_at_moves.append(len(node.queue))
            if sizes:
                last["size"] = max(sizes)
            original(indices)

        node.send_runtest_some = recording
    done = drive(WorldSizeScheduling(FakeConfig(WORKERS)), nodes, collection, seed=11, duration=duration)
    assert sorted(done) == list(range(len(collection)))
    assert left_at_moves and min(left_at_moves) >= 2, left_at_moves
    assert sum(left >= 8 for left in left_at_moves) >= len(left_at_moves) // 2, left_at_moves


def test_a_worker_that_dies_leaves_its_cases_to_the_others():
    collection = gate_collection()
    nodes = [FakeNode(f"gw{n}") for n in range(WORKERS)]
    done = drive(WorldSizeScheduling(FakeConfig(WORKERS)), nodes, collection, seed=1, kill=nodes[3])
    assert sorted(done) == list(range(len(collection))), "a dead worker's cases were lost or run twice"


def test_only_a_gpu_job_in_xdists_load_mode_gets_it():
    from qgather.pytest_plugin import affinity, gpu_schedule

    class Config(FakeConfig):
        def __init__(self, dist: str, gpu: bool) -> None:
            super().__init__(WORKERS)
            self.dist = dist
            self.stash = {gpu_schedule.lease_dir_key: "/tmp/x"} if gpu else {}

        def getoption(self, name: str, default: object = None) -> object:
            return self.dist if name == "dist" else super().getoption(name, default)

    assert isinstance(affinity.pytest_xdist_make_scheduler(Config("load", True), None), WorldSizeScheduling)
    assert affinity.pytest_xdist_make_scheduler(Config("load", False), None) is None
    assert affinity.pytest_xdist_make_scheduler(Config("loadgroup", True), None) is None


def test_the_lookahead_sees_the_first_case_past_a_full_lead():
    from qgather.pytest_plugin import affinity, lookahead

    assert affinity.LEAD_ITEMS < lookahead.WINDOW and affinity.MOVE_AHEAD < lookahead.WINDOW
