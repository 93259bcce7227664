"""The GPU job's xdist scheduling: a worker keeps to one world size while that size has cases left.

xdist's own load scheduling hands each worker the next cases in collection order, where the world
size changes every few ids: every worker soon holds a pool of every world size, and the GPUs pay each
pool's CUDA contexts, which one GPU makes one at a time (~0.18 s each on an H200, 32 at once 5.9 s:
docs/gpu-results.md, 2026-11-29), and each pool's process group. Here a worker is given cases of its
world size only. When that size has none left, it moves to a size it already has a pool of, or else
to the size with the most work left per worker already on it, and starts one pool there. A run starts
one pool per worker, and one for each move as the world sizes run dry at the end: driven as xdist
drives it (tests/test_affinity.py), 17-20 starts for 8 workers and 5 world sizes, against xdist's 40.

The cases' order within a world size, the chunk sizes and the end of the run are xdist's
`LoadScheduling`'s; the choice of which pending cases a worker is sent differs, and a worker is refilled
once MOVE_AHEAD cases are left in its queue rather than one, so that its next world size's pool starts
(qgather.pytest_plugin.lookahead) while the last cases of its current one run. Items that run on
no pool (the GPU-only tests, the dispatch checks, the virtual cases) are a "size" of their own, as cheap
as a world size of one; so are the cases that save a checkpoint at another world size, whatever other
options their configuration joins (`key_of`, from the case id as CaseSpec reads it). A worker's first
batch leads with its share of the no-pool items, taken across all of them (not the first virtual cases
for one worker and the GPU-only tests for another), which it runs while its first pool starts
(qgather.pytest_plugin.lookahead). Used where the
run's pools take GPU seats (qgather.pytest_plugin.gpu_schedule) and xdist's mode is its default `load`;
an explicit `--dist` is the user's.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
from xdist.scheduler import LoadScheduling

from qgather.model.case import CaseSpec, CaseSpecError
from qgather.pytest_plugin import gpu_schedule

_CASE_ID = re.compile(r"\[([^\]]*)\]$")
NO_POOL = 0  # the key of an item that runs on no pool (no case id, or a virtual case)
CHECKPOINT = -1  # the key of a dcp-wsA case: it runs on pools of two world sizes (the save's, its own)
# No-pool items at the head of a worker's first batch, for its first pool to start beside (lookahead.py):
# on the 2 x H200 gate (2026-11-29) a first start took 3-17 s; of the 459 no-pool items, a virtual case
# took 0.13 s on average and a GPU-only test 0.60 s (run U, 2026-11-29), ~16 s for an eighth of them.
# Fewer than lookahead.WINDOW, which must see the first case past them to start its pool.
LEAD_ITEMS = 60
# A worker is refilled once this many cases are left in its queue, not one (xdist's refill waits for that
# while tests take 0.1 s or more), so that a move to its next world size comes while they run and the
# lookahead (whose WINDOW must reach past them) starts the next pool meanwhile. On 2 x H200 (run V)
# a move's first case waited ~9 s, the whole start, begun as the case came.
MOVE_AHEAD = 32


def pool_sizes_of(nodeid: str) -> tuple[int, ...]:
    """The world sizes of the pools the case in `nodeid`'s brackets runs on (CaseSpec.pool_sizes: a
    dcp-wsA case's saving size too, whatever other options its configuration joins with `+`); none
    for an item whose brackets hold no case id."""
    spec = case_of(nodeid)
    return spec.pool_sizes if spec is not None else ()


def world_size_of(nodeid: str) -> int:
    """The world size a case id in `nodeid` names (NO_POOL: none)."""
    spec = case_of(nodeid)
    return spec.world_size if spec is not None else NO_POOL


def case_of(nodeid: str) -> CaseSpec | None:
    """The case whose id `nodeid`'s brackets hold, or None (a test that is not one case)."""
    match = _CASE_ID.search(nodeid)
    if match is None:
        return None
    try:
        return CaseSpec.parse(match.group(1))
    except CaseSpecError:
        return None


def key_of(nodeid: str) -> int:
    """Which worker's cases an item is: its pool's world size, CHECKPOINT's (a case that saves at
    another world size needs a pool of each: kept to a few workers, they start every size's pool once,
    not every worker), or NO_POOL's."""
    sizes = pool_sizes_of(nodeid)
    if len(sizes) > 1:
        return CHECKPOINT
    return sizes[0] if sizes else NO_POOL


def weight(key: int) -> float:
    """A case's relative cost (1 x H200 gate, 2026-11-29: ~0.4 s a case at 3 to 8 ranks on gloo over
    CUDA, ~0.25 s at one; a dcp-wsA case 3.2 s on average, its save and its load on two pools). Since
    then the cases' own seconds fell (0.11-0.18 s, a dcp-wsA case 0.24 s, runs M and N of 2026-11-29
    afternoon), but a worker that takes up dcp-wsA cases starts pools of several sizes: driven over
    run N's own ids and seconds with 4 s a pool start (tests/test_affinity.py's driver), these
    weights and weights from the cases' seconds alone start as many pools or more."""
    return 6.0 if key == CHECKPOINT else 1.0 + key / 8


def busiest(left: Counter[int], serving: Counter[int]) -> int | None:
    """The size a free worker should take: the most work left per worker already on it (None: no work)."""
    candidates = [size for size, count in left.items() if count > 0]
    if not candidates:
        return None
    return max(candidates, key=lambda size: (left[size] * weight(size) / (1 + serving[size]), size))


class WorldSizeScheduling(LoadScheduling):
    """LoadScheduling whose `_send_tests` sends a worker cases of the world size it keeps to."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self.node2size: dict[Any, int] = {}
        self.node2served: dict[Any, set[int]] = {}  # the sizes a node has pools of (warm ones, unless yielded)
        self._sizes: list[int] = []
        self._lead: int | None = None  # _lead_share's equal share, fixed at the first batch

    def _send_tests(self, node: Any, num: int) -> None:
        if num <= 0:
            return
        if self.collection is not None and len(self._sizes) != len(self.collection):
            self._sizes = [key_of(nodeid) for nodeid in self.collection]
        first = node not in self.node2served
        size = self._size_for(node)
        if size is None:
            return
        lead = self._spread_of_size(NO_POOL, self._lead_share(num)) if first and size != NO_POOL else []
        positions = [*lead, *self._first_of_size(size, num)]
        chosen = [self.pending[p] for p in positions]
        for position in sorted(positions, reverse=True):
            del self.pending[position]
        self.node2pending[node].extend(chosen)
        node.send_runtest_some(chosen)

    def _lead_share(self, num: int) -> int:
        """How many no-pool items go ahead of a worker's first cases: an equal share of those of the
        run (at most LEAD_ITEMS) and at most half the batch (qgather.pytest_plugin.lookahead starts the
        worker's pool meanwhile)."""
        if self._lead is None:
            no_pool = sum(1 for index in self.pending if self._sizes[index] == NO_POOL)
            self._lead = min(no_pool // max(len(self.nodes), 1), LEAD_ITEMS)
        return min(self._lead, num // 2)

    def check_schedule(self, node: Any, duration: float = 0, from_dsession: bool = False) -> None:
        """xdist's refill, except that a worker whose queue holds MOVE_AHEAD or fewer cases, all of its
        current size, is refilled now (_runs_low) rather than once it has one left."""
        if self._runs_low(node):
            self._send_tests(node, max(2, len(self.pending) // len(self.node2pending) // 2))
            return
        super().check_schedule(node, duration=duration)

    def _runs_low(self, node: Any) -> bool:
        """Whether cases are pending and the node's queue holds MOVE_AHEAD or fewer, all of its current
        size: refilled now, a move to another size (its size has none left) comes while they run."""
        queued = self.node2pending.get(node, [])
        if node.shutting_down or not self.pending or not 0 < len(queued) <= MOVE_AHEAD:
            return False
        current = self.node2size.get(node)
        return current is not None and all(self._sizes[index] == current for index in queued)

    def remove_node(self, node: Any) -> str | None:
        self.node2size.pop(node, None)
        self.node2served.pop(node, None)
        return super().remove_node(node)

    def _size_for(self, node: Any) -> int | None:
        """The node's size while it has pending cases, else the busiest size (None: nothing pending)."""
        current = self.node2size.get(node)
        if current is not None and any(self._sizes[i] == current for i in self.pending):
            return current
        left = Counter(self._sizes[i] for i in self.pending)
        serving = Counter(size for other, size in self.node2size.items() if other is not node)
        served = self.node2served.setdefault(node, set())
        warm = Counter({size: count for size, count in left.items() if size in served})
        chosen = busiest(warm, serving)
        if chosen is None:
            chosen = busiest(left, serving)
        if chosen is None:
            self.node2size.pop(node, None)
        else:
            self.node2size[node] = chosen
            served.add(chosen)
        return chosen

    def _spread_of_size(self, size: int, num: int) -> list[int]:
        """`num` positions of pending items of `size`, spread evenly over all of them: the no-pool items
        come in runs of one kind (the virtual cases, then the GPU-only tests, ~5x as long), and a lead
        of the first ones alone would cover one worker's first start and not another's."""
        positions = self._positions_of(size)
        count = min(num, len(positions))
        return [positions[k * len(positions) // count] for k in range(count)] if count > 0 else []

    def _first_of_size(self, size: int, num: int) -> list[int]:
        return self._positions_of(size)[:num]

    def _positions_of(self, size: int) -> list[int]:
        """The positions in `pending` of the items of `size`, in order."""
        return [position for position, index in enumerate(self.pending) if self._sizes[index] == size]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScheduling | None:
    """A GPU job's default scheduling keeps each worker to one world size (None: xdist's own)."""
    if config.getoption("dist", "no") != "load" or gpu_schedule.lease_dir_key not in config.stash:
        return None
    return WorldSizeScheduling(config, log)
