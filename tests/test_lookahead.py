"""The GPU job's pools start ahead of the cases queued for a worker (qgather.pytest_plugin.lookahead,
qgather.engine.run.start_pools_ahead): which pools, read from xdist's own queue, each case looked at once."""

from __future__ import annotations

import types

import execnet
import pytest
from xdist import remote

from qgather.engine import run as engine_run
from qgather.engine.run import RunOptions, cold_pools, start_pools_ahead
from qgather.model.case import CaseSpec
from qgather.pytest_plugin import lookahead
from qgather.runtime import PoolSpec

GATHER = "cases/test_alignment.py::test_gather[reference:fp8_tensor:4x64:bf16:ws2:gather:s0]"
DCP = "cases/test_checkpoint_compile.py::test_config[reference:fp8_tensor:4x64:bf16:ws3:gather:s0:dcp-ws1]"
OTHER = "tests/gpu/test_te.py::test_cross_check"


def test_one_case_at_a_time_asks_for_its_pools_and_each_is_looked_at_once():
    asked: list[str] = []

    def start(spec: CaseSpec, options: RunOptions) -> int:
        asked.append(spec.id)
        return 0 if spec.world_size == 4 else len(spec.pool_sizes)  # the ws4 case: skipped, say

    skipped = GATHER.replace(":ws2:", ":ws4:")
    looked: set[int] = set()
    queued = [(3, OTHER), (4, skipped), (5, GATHER), (6, DCP)]
    assert lookahead.start_ahead_of(queued, looked, RunOptions(), start) == 1
    assert asked == [case_id(skipped), case_id(GATHER)] and looked == {3, 4, 5}
    assert lookahead.start_ahead_of(queued, looked, RunOptions(), start) == 2  # the dcp case: two pools
    assert lookahead.start_ahead_of([*queued, (7, GATHER)], looked, RunOptions(), start) == 1
    assert lookahead.start_ahead_of([*queued, (7, GATHER)], looked, RunOptions(), start) == 0
    assert asked == [case_id(skipped), case_id(GATHER), case_id(DCP), case_id(GATHER)]


def case_id(nodeid: str) -> str:
    return nodeid.split("[")[1][:-1]


def _worker(queued: list[int], following: int | None, count: int) -> types.SimpleNamespace:
    interactor = remote.WorkerInteractor.__new__(remote.WorkerInteractor)
    interactor.torun = remote.TestQueue(execnet.gateway_base.get_execmodel("thread"))
    for index in queued:
        interactor.torun.put(index)
    interactor.nextitem_index = following
    interactor.session = types.SimpleNamespace(items=[types.SimpleNamespace(nodeid=f"t[{i}]") for i in range(count)])
    plugins = [object(), interactor]
    return types.SimpleNamespace(pluginmanager=types.SimpleNamespace(get_plugins=lambda: plugins))


def test_the_upcoming_items_are_xdists_next_then_its_queue_in_order_up_to_the_window():
    config = _worker(list(range(3, 3 + lookahead.WINDOW + 10)), following=2, count=100)
    got = lookahead.upcoming(config)
    assert [index for index, _ in got] == list(range(2, 3 + lookahead.WINDOW))
    assert got[0] == (2, "t[2]")


def test_outside_an_xdist_worker_nothing_is_upcoming():
    config = types.SimpleNamespace(pluginmanager=types.SimpleNamespace(get_plugins=lambda: [object()]))
    assert lookahead.upcoming(config) == []


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[PoolSpec]:
    """The pools start_pools_ahead starts, recorded instead of started; any pool spec valid here, every
    pool cold until recorded."""
    asked: list[PoolSpec] = []
    monkeypatch.setattr(engine_run, "start_ahead", lambda pool: asked.append(pool) or True)
    monkeypatch.setattr(engine_run, "is_cold", lambda pool: pool not in asked)
    monkeypatch.setattr(PoolSpec, "validate", lambda self: self)
    return asked


def test_a_checkpoint_case_starts_the_saves_pool_and_its_own_once(started):
    case = CaseSpec.parse(case_id(DCP))
    assert start_pools_ahead(case, RunOptions(device="cuda")) == 2
    assert [(pool.world_size, pool.device) for pool in started] == [(1, "cuda"), (3, "cuda")]
    assert cold_pools(case, RunOptions(device="cuda")) == [] and start_pools_ahead(case, RunOptions(device="cuda")) == 0


def test_cases_that_run_on_no_cuda_pool_start_none(started, monkeypatch):
    case = CaseSpec.parse("reference:fp8_tensor:4x64:bf16:ws2:gather:s0")
    assert start_pools_ahead(case, RunOptions(device="cpu")) == 0
    virtual = CaseSpec.parse("reference:fp8_tensor:4x64:bf16:ws2:virtual:s0")
    assert start_pools_ahead(virtual, RunOptions(device="cuda")) == 0
    monkeypatch.setattr(engine_run, "_skip_reason", lambda *args: "skipped here")
    assert start_pools_ahead(case, RunOptions(device="cuda")) == 0
    assert started == []


@pytest.mark.parametrize("busy", ["", "a start in the background", "this test's own start"])
def test_the_hook_starts_the_queued_cases_pools_in_a_gpu_jobs_worker_one_start_at_a_time(monkeypatch, busy):
    monkeypatch.setenv("QGATHER_GPU_LEASE_DIR", "/nonexistent")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setattr(lookahead, "settings", lambda config: types.SimpleNamespace(run=RunOptions()))
    monkeypatch.setattr(lookahead, "upcoming", lambda config: [(1, OTHER), (2, GATHER)])
    monkeypatch.setattr(lookahead, "starting_in_background", lambda: busy == "a start in the background")
    own_start = ["cold"] if busy == "this test's own start" else []
    monkeypatch.setattr(lookahead, "cold_pools", lambda spec, options: own_start)
    asked: list[str] = []
    monkeypatch.setattr(lookahead, "start_pools_ahead", lambda spec, options: asked.append(spec.id) or 1)
    item = types.SimpleNamespace(config=types.SimpleNamespace(stash=pytest.Stash()), nodeid=DCP)
    lookahead.pytest_runtest_protocol(item, None)
    lookahead.pytest_runtest_protocol(item, None)
    assert asked == ([] if busy else [case_id(GATHER)])


def test_a_pool_starting_in_the_background_is_seen_by_the_registry():
    from qgather.runtime import get_pool, is_cold, registry, starting_in_background

    spec = PoolSpec(backend="gloo", world_size=61, device="cpu")  # of no other test of this process
    assert is_cold(spec)  # no pool yet
    pool = get_pool(spec)
    try:
        assert is_cold(spec) and not starting_in_background()
        pool.restart.under_way = True
        assert starting_in_background() and not is_cold(spec)
    finally:
        pool.restart.under_way = False
        with registry._lock:
            registry._pools.pop(spec, None)
