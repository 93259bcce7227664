"""The GPU job's pools start before their cases ask: an xdist worker looks at the cases queued for it
and starts, in the background, the CUDA pools the next of them will run on, while it runs the ones
before (skips, virtual cases, the GPU-only tests, the last cases of its previous world size).

A pool start on the GPU gate costs seconds (a CUDA context per rank, NCCL's communicator, the first
barrier: 2-17 s a start on 2 x H200, 2026-11-29), and a worker's first start waited for all of it.
Started ahead, the case finds the pool up, or waits only for the rest of its start (timings.md's
"waiting for its start in the background", beside the early start's own phases): the seconds are the
same GPU work, spent while the worker does something else. The scheduler (affinity.py) sends each
worker's first batch with a share of the cases that run on no pool at its head, for the first start to
run beside.

Only in a GPU job (its workers share a lease directory, gpu_schedule.py): a CPU pool starts in well
under a second, and the CPU job keeps xdist's own scheduling.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence

import pytest

from qgather.engine.run import RunOptions, cold_pools, start_pools_ahead
from qgather.model.case import CaseSpec
from qgather.pytest_plugin.affinity import case_of
from qgather.pytest_plugin.options import settings
from qgather.runtime import gpu_lease, starting_in_background

#: how many of the worker's queued items it looks at: past the no-pool items the scheduler puts ahead of
#: a worker's first cases (affinity.LEAD_ITEMS), not much further (a pool started too early holds seats)
WINDOW = 64
looked_key = pytest.StashKey[set[int]]()  # the queued items (their index in session.items) looked at


def upcoming(config: pytest.Config) -> list[tuple[int, str]]:
    """The next items queued for this xdist worker, (index in session.items, node id), the next first;
    empty outside a worker or where xdist's queue cannot be read."""
    interactor = _worker_interactor(config)
    if interactor is None:
        return []
    try:
        with interactor.torun.lock() as queue:
            indices = list(itertools.islice(queue, WINDOW))
        following = [interactor.nextitem_index, *indices]
        items = interactor.session.items
    except AttributeError:  # an xdist whose worker keeps its queue otherwise: start pools as cases ask
        return []
    return [(index, items[index].nodeid) for index in following if isinstance(index, int)]


def start_ahead_of(queued: Sequence[tuple[int, str]], looked: set[int], options: RunOptions,
                   start: Callable[[CaseSpec, RunOptions], int]) -> int:
    """`start` (e.g. start_pools_ahead) the pools of the first queued case not looked at yet that asks for
    any; the cases looked at are added to `looked`. How many pools it asked for: one case's at a time, so
    that a worker whose queue holds cases of several sizes (the `dcp-wsA` cases) does not start them all
    at once beside every other worker's first start."""
    for index, nodeid in queued:
        if index in looked:
            continue
        looked.add(index)
        spec = case_of(nodeid)
        asked = start(spec, options) if spec is not None else 0
        if asked:
            return asked
    return 0


def in_gpu_job() -> bool:
    """Whether this process is a worker of a GPU job (the controller set its shared lease directory)."""
    return gpu_lease.LEASE_DIR_ENV in os.environ and bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _worker_interactor(config: pytest.Config) -> object | None:
    try:
        from xdist.remote import WorkerInteractor
    except ImportError:
        return None
    return next((p for p in config.pluginmanager.get_plugins() if isinstance(p, WorkerInteractor)), None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Before each test of a GPU job's worker: the pools of the cases queued next start, if not yet.
    One start at a time: none while one is under way in the background or this test's case will start
    its own (the next test looks again)."""
    if not in_gpu_job() or starting_in_background():
        return
    options = settings(item.config).run
    current = case_of(item.nodeid)
    if current is not None and cold_pools(current, options):
        return
    looked = item.config.stash.setdefault(looked_key, set())
    start_ahead_of(upcoming(item.config), looked, options, start_pools_ahead)
