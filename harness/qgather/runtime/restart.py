"""A pool's restart in the background (PoolSpec.restarts_in_background): when a failed case left a CUDA
pool without ranks, its ranks start again at once in a thread of their own, while the runner reports the
case and goes on, rather than when the next case asks (a start there costs seconds of CUDA contexts)."""

from __future__ import annotations

import threading
from collections.abc import Callable

#: a pool start's phase in timings.md: the seconds a case waited for a restart under way
RESTART_WAIT = "waiting for a restart in the background"
#: the restart's own phases (RankPool.start_phases) beside that wait, each under this prefix: what the wait was
RESTART_PHASE = "the restart: "
#: the same for a pool's first start, begun in the background before a case asked (a dcp-wsA case's own
#: pool, while the save runs at the other world size)
START_WAIT = "waiting for its start in the background"
START_PHASE = "the early start: "


class BackgroundRestart:
    """One pool's restarts: launched by `launch`, cancelled by `cancel` (a shutdown) while not yet begun."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.under_way = False  # read without a lock: a case that saw it counts its wait for the pool
        self.first = False  # the pool's first start (no ranks ever), not a restart
        self.thread: threading.Thread | None = None
        self._generation = 0

    def labels(self) -> tuple[str, str]:
        """The wait's phase name and its start's prefix in timings.md."""
        return (START_WAIT, START_PHASE) if self.first else (RESTART_WAIT, RESTART_PHASE)

    def cancel(self) -> None:
        """A restart launched before this call and not yet begun does not begin."""
        self._generation += 1

    def launch(self, lock: threading.Lock, start: Callable[[], object], first: bool = False) -> None:
        """Run `start` under `lock` in a daemon thread (`first`: the pool's first start). What fails there is
        left to the next case, which starts the pool itself and reports it."""
        generation = self._generation
        self.under_way, self.first = True, first

        def restart() -> None:
            try:
                with lock:
                    if generation == self._generation:
                        start()
            except BaseException:  # noqa: BLE001 - the next case's own start reports what fails
                pass
            finally:
                self.under_way = False

        self.thread = threading.Thread(target=restart, name=f"qgather-restart-{self.name}", daemon=True)
        self.thread.start()
