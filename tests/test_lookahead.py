"""The GPU job's pools start ahead of the cases queued for a worker (qgather.pytest_plugin.lookahead,
qgather.engine.run.start_pools_ahead): which pools, read from xdist's own queue, each case looked at once."""

from __future__ import annotations

import types

import execnet
import pytest
from xdist import remote

from qgather.engine import run as engine_run
from qgather.engine.run import RunOptions, start_pools_ahead
from qgather.model.case import CaseSpec
from qgather.pytest_plugin import lookahead
from qgather.runtime import PoolSpec

GATHER = "cases/test_alignment.py::test_gather[reference:fp8_tensor:4x64:bf16:ws2:gather:s0]"
DCP = "cases/test_checkpoint_compile.py::test_config[reference:fp8_tensor:4x64:bf16:ws3:gather:s0:dcp-ws1]"
OTHER = "tests/gpu/test_te.py::test_cross_check"


def test_each_queued_case_is_looked_at_once_and_other_tests_start_nothing():
    asked: list[str] = []

    def start(spec: CaseSpec, options: RunOptions) -> int:
        asked.append(spec.id)
        return 1

    looked: set[int] = set()
    queued = [(4, OTHER), (5, GATHER), (6, DCP)]
    assert lookahead.start_ahead_of(queued, looked, RunOptions(), start) == 2
    assert asked == [GATHER.split("[")[1][:-1], DCP.split("[")[1][:-1]]
    assert lookahead.start_ahead_of([(6, DCP), (7, GATHER)], looked, RunOptions(), start) == 1
    assert looked == {4, 5, 6, 7}


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
    """The pools start_pools_ahead asks for, recorded instead of started; any pool spec valid here."""
    asked: list[PoolSpec] = []
    monkeypatch.setattr(engine_run, "start_ahead", asked.append)
    monkeypatch.setattr(PoolSpec, "validate", lambda self: self)
    return asked


def test_a_checkpoint_case_asks_for_the_saves_pool_and_its_own(started):
    assert start_pools_ahead(CaseSpec.parse(DCP.split("[")[1][:-1]), RunOptions(device="cuda")) == 2
    assert [(pool.world_size, pool.device) for pool in started] == [(1, "cuda"), (3, "cuda")]


def test_cases_that_run_on_no_cuda_pool_ask_for_none(started, monkeypatch):
    case = CaseSpec.parse("reference:fp8_tensor:4x64:bf16:ws2:gather:s0")
    assert start_pools_ahead(case, RunOptions(device="cpu")) == 0
    virtual = CaseSpec.parse("reference:fp8_tensor:4x64:bf16:ws2:virtual:s0")
    assert start_pools_ahead(virtual, RunOptions(device="cuda")) == 0
    monkeypatch.setattr(engine_run, "_skip_reason", lambda *args: "skipped here")
    assert start_pools_ahead(case, RunOptions(device="cuda")) == 0
    assert started == []


def test_the_hook_does_nothing_outside_a_gpu_job(monkeypatch):
    monkeypatch.delenv("QGATHER_GPU_LEASE_DIR", raising=False)
    called = []
    monkeypatch.setattr(lookahead, "start_ahead_of", lambda *args: called.append(args))
    item = types.SimpleNamespace(config=None)
    lookahead.pytest_runtest_protocol(item, None)
    assert called == []


def test_the_hook_starts_the_queued_cases_pools_in_a_gpu_jobs_worker(monkeypatch):
    monkeypatch.setenv("QGATHER_GPU_LEASE_DIR", "/nonexistent")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setattr(lookahead, "settings", lambda config: types.SimpleNamespace(run=RunOptions()))
    monkeypatch.setattr(lookahead, "upcoming", lambda config: [(1, GATHER), (2, OTHER)])
    asked: list[str] = []
    monkeypatch.setattr(lookahead, "start_pools_ahead", lambda spec, options: asked.append(spec.id) or 1)
    item = types.SimpleNamespace(config=types.SimpleNamespace(stash=pytest.Stash()))
    lookahead.pytest_runtest_protocol(item, None)
    lookahead.pytest_runtest_protocol(item, None)
    assert asked == ["reference:fp8_tensor:4x64:bf16:ws2:gather:s0"]
