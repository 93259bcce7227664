"""The GPU job's pools start before their cases ask: an xdist worker looks at the items queued for it,
starts in the background the CUDA pools of the next case that needs one not up yet, and while such a
start is under way runs the queued items that need no pool first (skips, virtual cases, the GPU-only
tests, cases of pools that are up).

A pool start on the GPU gate costs seconds (a CUDA context per rank, NCCL's communicator, the first
barrier: 2-17 s a start on 2 x H200, 2026-11-29), and a worker's first case waited for all of it.
Started ahead, the case finds the pool up, or waits only for the rest of its start (timings.md's
"waiting for its start in the background", beside the early start's own phases): the same GPU work,
spent while the worker does something else. The scheduler (affinity.py) puts a share of the no-pool
items at the head of each worker's first batch, for its first start to run beside.

One start at a time per worker: none while one is under way in the background or while the test about
to run will start its own (a `dcp-wsA` worker's queue holds cases of every size; starting them all at
once would crowd every other worker's first start). The order of the items that run is the worker's
own: xdist's controller counts each item done whenever it reports, and the item xdist has taken out
of the queue to run next (pytest's `nextitem`) is never moved.

Only in a GPU job (its workers share a lease directory, gpu_schedule.py): a CPU pool starts in well
under a second, and the CPU job keeps xdist's own order.
"""

from __future__ import annotations

import collections
import itertools
import os
from dataclasses import dataclass, field

import pytest

from qgather.engine.run import RunOptions, case_pools
from qgather.pytest_plugin.affinity import case_of
from qgather.pytest_plugin.options import settings
from qgather.runtime import PoolSpec, gpu_lease, is_cold, is_up, start_ahead, starting_in_background

#: how many of the worker's queued items it looks at: past the no-pool items the scheduler puts ahead of
#: a worker's first cases (affinity.LEAD_ITEMS), not much further (a pool started too early holds seats)
WINDOW = 64


@dataclass
class Lookahead:
    """One worker's view of the items queued for it (by index in session.items): each one's pools."""

    options: RunOptions
    items: list[pytest.Item]
    pools: dict[int, tuple[PoolSpec, ...]] = field(default_factory=dict)

    def pools_of(self, index: int) -> tuple[PoolSpec, ...]:
        """The CUDA pools the item runs on (none: it runs on no pool, or is skipped), read once."""
        if index not in self.pools:
            spec = case_of(self.items[index].nodeid)
            self.pools[index] = case_pools(spec, self.options) if spec is not None else ()
        return self.pools[index]

    def start_next(self, queued: list[int]) -> int:
        """Start in the background the cold pools of the first queued item that has any; how many began."""
        for index in queued:
            cold = [pool for pool in self.pools_of(index) if is_cold(pool)]
            if cold:
                return sum(start_ahead(pool) for pool in cold)
        return 0

    def ready(self, index: int) -> bool:
        """Whether the item would run now: it needs no pool, or every one of its pools is up."""
        return all(is_up(pool) for pool in self.pools_of(index))

    def ready_first(self, queue: collections.deque) -> int | None:
        """While the queue's head would wait for a pool, the first item of the window that would not
        moves to the head; the index moved (None: none). Only items whose pools were read already
        (pools_of) are judged: this runs under xdist's lock on the queue. The SHUTDOWN marker stays last."""
        window = [index for index in itertools.islice(queue, WINDOW) if index in self.pools]
        if not window or window[0] != queue[0] or self.ready(window[0]):
            return None
        index = next((i for i in window[1:] if self.ready(i)), None)
        if index is not None:
            queue.remove(index)
            queue.appendleft(index)
        return index


lookahead_key = pytest.StashKey[Lookahead]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Before each test of a GPU job's worker: the next cold pool of the queued cases starts in the
    background, and while a start is under way the items that would not wait for it run first."""
    if not in_gpu_job():
        return
    interactor = _worker_interactor(item.config)
    queued = _queued(interactor)
    if queued is None:
        return
    state = _state(item.config, item)
    for index in queued:
        state.pools_of(index)  # read here, not under xdist's lock (a library's first import takes seconds)
    current = getattr(interactor, "item_index", None)  # this test's, read as the previous test's next
    own_start = isinstance(current, int) and any(is_cold(pool) for pool in state.pools_of(current))
    if not own_start and not starting_in_background():
        state.start_next(queued)
    if starting_in_background():
        with interactor.torun.lock() as queue:
            state.ready_first(queue)


def in_gpu_job() -> bool:
    """Whether this process is a worker of a GPU job (the controller set its shared lease directory)."""
    return gpu_lease.LEASE_DIR_ENV in os.environ and bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _state(config: pytest.Config, item: pytest.Item) -> Lookahead:
    if lookahead_key not in config.stash:
        config.stash[lookahead_key] = Lookahead(settings(config).run, item.session.items)
    return config.stash[lookahead_key]


def _queued(interactor: object | None) -> list[int] | None:
    """The items this worker runs next: xdist's `nextitem` (taken out of the queue already), then the
    window of its queue; None outside a worker or where xdist keeps its queue otherwise."""
    torun = getattr(interactor, "torun", None)
    if torun is None or not hasattr(torun, "lock"):
        return None
    with torun.lock() as queue:
        window = list(itertools.islice(queue, WINDOW))
    return [index for index in (getattr(interactor, "nextitem_index", None), *window) if isinstance(index, int)]


def _worker_interactor(config: pytest.Config) -> object | None:
    """xdist's worker plugin, by its class name: the worker runs xdist.remote's code as execnet's
    channel module, so its class is not the one `import xdist.remote` gives."""
    plugins = config.pluginmanager.get_plugins()
    return next((p for p in plugins if type(p).__name__ == "WorkerInteractor" and hasattr(p, "torun")), None)
