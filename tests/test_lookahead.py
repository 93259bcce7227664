"""The GPU job's pools start ahead of the cases queued for a worker (qgather.pytest_plugin.lookahead,
qgather.engine.run.case_pools): which pools, read from xdist's own queue, one start at a time, and the
items that would not wait for a pool run first while one starts."""

from __future__ import annotations

import collections
import types

import execnet
import pytest
from xdist import remote

from qgather.engine import run as engine_run
from qgather.engine.run import RunOptions, case_pools
from qgather.model.case import CaseSpec
from qgather.pytest_plugin import lookahead
from qgather.runtime import PoolSpec

GATHER = "cases/test_alignment.py::test_gather[reference:fp8_tensor:4x64:bf16:ws2:gather:s0]"
DCP = "cases/test_checkpoint_compile.py::test_config[reference:fp8_tensor:4x64:bf16:ws3:gather:s0:dcp-ws1]"
OTHER = "tests/gpu/test_te.py::test_cross_check"
WS = {size: PoolSpec(backend="gloo", world_size=size, device="cuda") for size in (1, 2, 3, 4)}


def case_id(nodeid: str) -> str:
    return nodeid.split("[")[1][:-1]


class Pools:
    """Stands in for the registry: which pools are up, starting, or cold; what start_ahead began."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.up: set[PoolSpec] = set()
        self.starting: set[PoolSpec] = set()
        self.began: list[PoolSpec] = []
        monkeypatch.setattr(lookahead, "is_up", lambda pool: pool in self.up)
        monkeypatch.setattr(lookahead, "is_cold", lambda pool: pool not in self.up | self.starting)
        monkeypatch.setattr(lookahead, "start_ahead", self._start)
        monkeypatch.setattr(lookahead, "starting_in_background", lambda: bool(self.starting))

    def _start(self, pool: PoolSpec) -> bool:
        self.began.append(pool)
        self.starting.add(pool)
        return True


def _state(pools_by_index: dict[int, tuple[PoolSpec, ...]]) -> lookahead.Lookahead:
    items = [types.SimpleNamespace(nodeid=f"t[{i}]") for i in range(max(pools_by_index) + 1)]
    return lookahead.Lookahead(RunOptions(), items, dict(pools_by_index))


def test_the_first_queued_case_with_cold_pools_starts_them_and_only_it(monkeypatch):
    pools = Pools(monkeypatch)
    pools.up.add(WS[2])
    state = _state({3: (), 4: (WS[2],), 5: (WS[1], WS[3]), 6: (WS[4],)})
    assert state.start_next([3, 4, 5, 6]) == 2  # the dcp case: its save's pool and its own
    assert pools.began == [WS[1], WS[3]]
    assert state.start_next([3, 4, 5, 6]) == 1 and pools.began[-1] == WS[4]  # the hook waits for the first


def test_while_a_pool_starts_the_first_item_that_would_not_wait_moves_to_the_queues_head(monkeypatch):
    pools = Pools(monkeypatch)
    pools.up.add(WS[2])
    pools.starting.add(WS[4])
    state = _state({10: (WS[4],), 11: (WS[4],), 12: (), 13: (WS[2],)})
    queue = collections.deque([10, 11, 12, 13, remote.Marker.SHUTDOWN])
    assert state.ready_first(queue) == 12 and list(queue)[:4] == [12, 10, 11, 13]
    assert state.ready_first(queue) is None  # the head (12) runs now
    queue.popleft()
    assert state.ready_first(queue) == 13 and queue[-1] is remote.Marker.SHUTDOWN
    pools.starting.clear()
    pools.up.add(WS[4])
    queue.popleft()
    assert state.ready_first(queue) is None and list(queue)[:2] == [10, 11]  # up: the order stays


def test_items_whose_pools_were_not_read_are_left_where_they_are(monkeypatch):
    Pools(monkeypatch).starting.add(WS[4])
    state = _state({10: (WS[4],), 12: ()})
    queue = collections.deque([10, 11, 12])
    state.pools.pop(12)
    assert state.ready_first(queue) is None and list(queue) == [10, 11, 12]


def _interactor(queued: list[int], following: int | None, current: int = 0) -> remote.WorkerInteractor:
    interactor = remote.WorkerInteractor.__new__(remote.WorkerInteractor)
    interactor.item_index = current
    interactor.torun = remote.TestQueue(execnet.gateway_base.get_execmodel("thread"))
    for index in queued:
        interactor.torun.put(index)
    interactor.nextitem_index = following
    return interactor


def test_the_queued_items_are_xdists_next_then_its_queue_in_order_up_to_the_window():
    got = lookahead._queued(_interactor(list(range(3, 3 + lookahead.WINDOW + 10)), following=2))
    assert got == list(range(2, 3 + lookahead.WINDOW))
    assert lookahead._queued(None) is None  # outside an xdist worker


@pytest.fixture
def valid_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PoolSpec, "validate", lambda self: self)


def test_a_checkpoint_case_runs_on_the_saves_pool_and_its_own(valid_here):
    got = case_pools(CaseSpec.parse(case_id(DCP)), RunOptions(device="cuda"))
    assert [(pool.world_size, pool.device) for pool in got] == [(1, "cuda"), (3, "cuda")]


def test_cases_that_run_on_no_cuda_pool_have_none(valid_here, monkeypatch):
    case = CaseSpec.parse(case_id(GATHER))
    assert case_pools(case, RunOptions(device="cpu")) == ()
    virtual = CaseSpec.parse("reference:fp8_tensor:4x64:bf16:ws2:virtual:s0")
    assert case_pools(virtual, RunOptions(device="cuda")) == ()
    monkeypatch.setattr(engine_run, "_skip_reason", lambda *args: "skipped here")
    assert case_pools(case, RunOptions(device="cuda")) == ()


def _item(nodeid: str, interactor: remote.WorkerInteractor, nodeids: list[str]) -> types.SimpleNamespace:
    plugins = [object(), interactor]
    manager = types.SimpleNamespace(get_plugins=lambda: plugins)
    config = types.SimpleNamespace(stash=pytest.Stash(), pluginmanager=manager)
    session = types.SimpleNamespace(items=[types.SimpleNamespace(nodeid=n) for n in nodeids])
    return types.SimpleNamespace(config=config, nodeid=nodeid, session=session)


@pytest.mark.parametrize("busy", ["", "this test's own start"])
def test_the_hook_starts_the_next_cold_pool_unless_this_test_starts_its_own(monkeypatch, busy):
    monkeypatch.setenv("QGATHER_GPU_LEASE_DIR", "/nonexistent")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setattr(lookahead, "settings", lambda config: types.SimpleNamespace(run=RunOptions()))
    own = {DCP: (WS[1],) if busy else (), OTHER: (), GATHER: (WS[2],)}
    monkeypatch.setattr(lookahead, "case_pools", lambda spec, options: own[next(n for n in own if spec.id in n)])
    pools = Pools(monkeypatch)
    nodeids = [DCP, OTHER, GATHER, OTHER]
    interactor = _interactor([2, 3], following=1, current=0)
    lookahead.pytest_runtest_protocol(_item(DCP, interactor, nodeids), None)
    assert pools.began == ([] if busy else [WS[2]])
    if not busy:  # the gather case waits for ws2's start: the other test after it runs first
        with interactor.torun.lock() as queue:
            assert list(queue) == [3, 2]


def test_the_hook_does_nothing_outside_a_gpu_job(monkeypatch):
    monkeypatch.delenv("QGATHER_GPU_LEASE_DIR", raising=False)
    monkeypatch.setattr(lookahead, "_worker_interactor", lambda config: pytest.fail("looked at the queue"))
    lookahead.pytest_runtest_protocol(types.SimpleNamespace(config=None, nodeid=GATHER), None)


def test_a_pool_starting_in_the_background_is_seen_by_the_registry():
    from qgather.runtime import get_pool, is_cold, is_up, registry, starting_in_background

    spec = PoolSpec(backend="gloo", world_size=61, device="cpu")  # of no other test of this process
    assert is_cold(spec) and not is_up(spec)  # no pool yet
    pool = get_pool(spec)
    try:
        assert is_cold(spec) and not starting_in_background()
        pool.restart.under_way = True
        assert starting_in_background() and not is_cold(spec) and not is_up(spec)
    finally:
        pool.restart.under_way = False
        with registry._lock:
            registry._pools.pop(spec, None)


def test_xdists_worker_plugin_is_found_by_its_class_name():
    """In a worker, xdist.remote runs as execnet's channel module: its WorkerInteractor is another class
    than the one `import xdist.remote` gives (run on the CPU, an isinstance check found none)."""

    class WorkerInteractor:  # as the channel module defines it
        torun = remote.TestQueue(execnet.gateway_base.get_execmodel("thread"))

    plugins = [object(), WorkerInteractor()]
    config = types.SimpleNamespace(pluginmanager=types.SimpleNamespace(get_plugins=lambda: plugins))
    assert lookahead._worker_interactor(config) is plugins[1]
