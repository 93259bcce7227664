"""GpuScheduling: xdist's scope scheduling with units of cases that need the same GPUs, handed to
the worker they suit (the rules are in qgather.pytest_plugin.gpu_schedule)."""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from qgather.pytest_plugin.gpu_schedule import FREE, unit_needs


class GpuScheduling(LoadScopeScheduling):
    """Units of up to CHUNK cases of one GPU need, each handed to the worker it suits (`_pick`)."""

    def __init__(self, config: pytest.Config, log: Any, gpus: int) -> None:
        super().__init__(config, log)
        self.gpus = gpus
        self._units: dict[str, tuple[str, int]] = {}
        self._need_of_unit: dict[str, int] = {}
        self._last_need: dict[Any, int] = {}

    def _split_scope(self, nodeid: str) -> str:
        if not self._units:
            self._index()
        return self._units.get(nodeid, (nodeid, FREE))[0]

    def _index(self) -> None:
        collection = self.collection or next(iter(self.registered_collections.values()), [])
        self._units = unit_needs(list(collection), self.gpus)
        self._need_of_unit = {unit: need for unit, need in self._units.values()}

    def _assign_work_unit(self, node: Any) -> None:
        self.workqueue.move_to_end(self._pick(node), last=False)
        super()._assign_work_unit(node)

    def _pick(self, node: Any) -> str:
        """The unit `node` runs next: one of the size it ran last (its pool stays warm); else the
        largest that fits in the GPUs the other workers are not using (the widest pools run while
        the GPUs are free, the one-GPU cases fill the end); else one that needs no GPU; else the
        smallest (the worker waits for its lease, which frees soonest)."""
        needs = [(unit, self._need_of_unit.get(unit, FREE)) for unit in self.workqueue]
        gpu_units = [(unit, need) for unit, need in needs if need != FREE]
        last = self._last_need.get(node)
        free_gpus = self.gpus - self._in_use(node)
        fitting = [(unit, need) for unit, need in gpu_units if need <= free_gpus]
        choice = next((unit for unit, need in gpu_units if need == last), None) \
            or (max(fitting, key=lambda u: u[1])[0] if fitting else None) \
            or next((unit for unit, need in needs if need == FREE), None) \
            or min(gpu_units, key=lambda u: u[1])[0]
        need = self._need_of_unit.get(choice, FREE)
        if need != FREE:
            self._last_need[node] = need
        return choice

    def _in_use(self, node: Any) -> int:
        """GPUs the other workers' unfinished GPU units lease (a worker runs one pool size at a time)."""
        used = 0
        for other, work in self.assigned_work.items():
            if other is node:
                continue
            pending = [self._need_of_unit.get(unit, FREE) for unit, tests in work.items() if not all(tests.values())]
            used += max(pending, default=FREE)
        return used
