"""External launcher mode: every rank is already a process (torchrun, SLURM), pytest runs on each.

There is no process to kill here, so containment is weaker than in a RankPool: each rank runs the
case in-process, a watchdog thread snapshots the stacks at the case timeout, and the ranks exchange
what happened over a separate gloo group (all_gather_object), so every rank returns the same
CaseOutcome and pytest decides the same thing everywhere. A collective that never completes ends
at the process group timeout (the case default + a margin); a rank blocked outside any collective
past that is ended with exit code 124 rather than hanging the job.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from harness.runtime.outcome import CaseOutcome, RankError
from harness.runtime.spec import PoolSpec, PoolSpecError
from harness.runtime.worker import PICKLE_PROTOCOL, CaseContext, to_cpu

PG_TIMEOUT_MARGIN_S = 10.0  # collectives time out this long after the default case timeout
CONTROL_TIMEOUT_MARGIN_S = 120.0
EXIT_AFTER_S = 60.0  # past the collective timeout, a still-stuck rank exits with code 124


def external_world() -> tuple[int, int] | None:
    """(rank, world size) when a launcher started this process as one rank of a job, else None."""
    env = os.environ
    rendezvous = "MASTER_ADDR" in env and "MASTER_PORT" in env
    if "RANK" in env and "WORLD_SIZE" in env and (rendezvous or "TORCHELASTIC_RUN_ID" in env):
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    # srun without torchrun: SLURM numbers the tasks, the job script exports MASTER_ADDR/PORT.
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and rendezvous:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    return None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def is_reporting_rank() -> bool:
    """True on the one process that should print (rank 0 of an external job, or a plain process)."""
    world = external_world()
    return world is None or world[0] == 0


class _World:
    """The launcher's process group, shared by every ExternalPool of this process."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.owned = False
        self.generation = 0
        self.broken = ""
        self._store: Any = None
        self._backend = ""
        self._control: Any = None
        self._groups: dict[str, Any] = {}
        self._meshes: dict[str, Any] = {}

    def join(self, spec: PoolSpec) -> None:
        import torch.distributed as dist

        if self._control is not None:
            return
        if not dist.is_initialized():
            self._init_default(spec, store=None)
            self.owned = True
        self._backend = dist.get_backend()
        self._control = dist.new_group(backend="gloo", timeout=_timedelta(
            spec.case_timeout_s + PG_TIMEOUT_MARGIN_S + CONTROL_TIMEOUT_MARGIN_S))

    def _init_default(self, spec: PoolSpec, store: Any) -> None:
        import torch.distributed as dist

        device = bind_device(spec)
        kwargs: dict[str, Any] = {"init_method": "env://"} if store is None else {"store": store}
        dist.init_process_group(spec.backend, rank=self.rank, world_size=self.world_size,
                                timeout=_timedelta(spec.case_timeout_s + PG_TIMEOUT_MARGIN_S),
                                device_id=device if spec.backend == "nccl" else None, **kwargs)
        if store is None:
            from torch.distributed import distributed_c10d

            self._store = distributed_c10d._get_default_store()

    def group(self, backend: str) -> Any:
        import torch.distributed as dist

        if backend == self._backend:
            return dist.group.WORLD
        if backend not in self._groups:
            self._groups[backend] = dist.new_group(backend=backend)
        return self._groups[backend]

    def mesh(self, spec: PoolSpec, device: Any) -> Any:
        if spec.backend not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

            group = self.group(spec.backend)
            if spec.backend == self._backend:
                mesh = init_device_mesh(device.type, (self.world_size,))
            else:
                mesh = DeviceMesh.from_group(group, device.type)
            self._meshes[spec.backend] = mesh
        return self._meshes[spec.backend]

    @property
    def control(self) -> Any:
        return self._control

    def close(self) -> None:
        """Destroy the process group if this runtime created it (at shutdown, on every rank)."""
        import torch.distributed as dist

        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        self.owned, self._control, self._groups, self._meshes = False, None, {}, {}

    def rebuild(self, spec: PoolSpec) -> None:
        """A new process group under a fresh store prefix; only for a group this runtime created."""
        import torch.distributed as dist

        if not self.owned:
            return
        dist.destroy_process_group()
        self.generation += 1
        self._control, self._groups, self._meshes = None, {}, {}
        self._init_default(spec, dist.PrefixStore(f"qgather/gen{self.generation}", self._store))
        self.join(spec)


_world: _World | None = None


def _shared_world(rank: int, world_size: int) -> _World:
    global _world
    if _world is None:
        _world = _World(rank, world_size)
    return _world


def bind_device(spec: PoolSpec) -> Any:
    import torch

    if spec.device == "cpu":
        return torch.device("cpu")
    index = local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class ExternalPool:
    """Same `run` as RankPool, for a world the launcher already made."""

    def __init__(self, spec: PoolSpec, world: tuple[int, int]) -> None:
        rank, world_size = world
        if spec.shape_problem():
            raise PoolSpecError(f"{spec}: {spec.shape_problem()}")
        problem = _external_problem(spec, world_size)
        if problem:
            raise PoolSpecError(problem)
        self.spec = spec
        self._world = _shared_world(rank, world_size)

    @property
    def rank(self) -> int:
        return self._world.rank

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            case_id: str = "", seed: int = 0) -> CaseOutcome:
        from harness.runtime.pool import _check_timeout, _pickle_case

        _pickle_case(fn, args)  # the same one-line error as a RankPool for an unsendable case
        limit = _check_timeout(timeout, self.spec.case_timeout_s)
        if self._world.broken:
            raise RuntimeError(f"external world unusable since {self._world.broken}")
        self._world.join(self.spec)
        report = self._run_here(fn, args, limit, case_id, seed)
        reports = self._exchange(report, case_id)
        if reports is None:
            return self._lost_peer(report, case_id)
        outcome = _merge(reports, case_id)
        if outcome.status != "ok" and not _rejected_everywhere(outcome):
            self._world.rebuild(self.spec)
        return outcome

    def shutdown(self) -> None:
        """The launcher owns the processes; only the process group this runtime made goes."""
        self._world.close()

    def _run_here(self, fn: Callable[..., Any], args: tuple[Any, ...], limit: float, case_id: str,
                  seed: int) -> dict[str, Any]:
        watchdog = _Watchdog(limit, self.spec.case_timeout_s + PG_TIMEOUT_MARGIN_S + EXIT_AFTER_S, case_id)
        watchdog.start()
        start = time.monotonic()
        try:
            report = run_case(self, fn, args, seed, case_id)
        finally:
            watchdog.finish()
        report.update(rank=self.rank, elapsed=time.monotonic() - start, stacks=watchdog.stacks)
        return report

    def _exchange(self, report: dict[str, Any], case_id: str) -> list[dict[str, Any]] | None:
        import torch.distributed as dist

        reports: list[Any] = [None] * self._world.world_size
        try:
            dist.all_gather_object(reports, report, group=self._world.control)
        except Exception as exc:
            self._world.broken = f"case {case_id!r}: result exchange failed: {exc}"
            return None
        return reports

    def _lost_peer(self, report: dict[str, Any], case_id: str) -> CaseOutcome:
        results: list[Any] = [None] * self._world.world_size
        results[self.rank] = report.get("result")
        return CaseOutcome("crash", results, exit_codes={}, duration_s=report["elapsed"], case_id=case_id,
                           note=self._world.broken)


def run_case(pool: ExternalPool, fn: Callable[..., Any], args: tuple[Any, ...], seed: int,
             case_id: str) -> dict[str, Any]:
    """Barrier, seed, run the case on this rank (this name is looked for in stacks)."""
    import torch
    import torch.distributed as dist

    spec, world = pool.spec, pool._world
    try:
        group = world.group(spec.backend)
        device = bind_device(spec)
        dist.barrier(group=group)
        torch.manual_seed(seed)
        random.seed(seed)
        ctx = CaseContext(world.rank, world.world_size, spec.backend, device, group, seed, case_id,
                          lambda: world.mesh(spec, device))
        result = to_cpu(fn(ctx, *args))
        pickle.dumps(result, protocol=PICKLE_PROTOCOL)  # fail here, as this rank's error
        return {"result": result, "error": None}
    except Exception as exc:  # not BaseException: Ctrl-C must still stop pytest on this rank
        return {"result": None, "error": RankError.from_exception(world.rank, exc)}


class _Watchdog(threading.Thread):
    """Snapshots every thread's stack at the case timeout; ends the process if it never returns."""

    def __init__(self, timeout: float, exit_after: float, case_id: str) -> None:
        super().__init__(name="qgather-watchdog", daemon=True)
        self.timeout = timeout
        self.exit_after = max(exit_after, timeout)
        self.case_id = case_id
        self.stacks = ""
        self._done = threading.Event()

    def run(self) -> None:
        if self._done.wait(self.timeout):
            return
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            self.stacks = f.read()
        if self._done.wait(self.exit_after - self.timeout):
            return
        print(f"qgather: case {self.case_id!r} still blocked after {self.exit_after:.0f} s on this rank; "
              f"exiting with code 124. Stacks at the timeout:\n{self.stacks}", file=sys.stderr, flush=True)
        os._exit(124)

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=5.0)


def _merge(reports: list[dict[str, Any]], case_id: str) -> CaseOutcome:
    world_size = len(reports)
    hung = [r["rank"] for r in reports if r["stacks"]]
    results = [None if r["rank"] in hung else r["result"] for r in reports]
    errors = {r["rank"]: r["error"] for r in reports if r["error"] is not None and r["rank"] not in hung}
    status = "hang" if hung else "error" if errors else "ok"
    return CaseOutcome(
        status=status, results=results[:world_size], errors=errors,
        stacks={r["rank"]: r["stacks"] for r in reports if r["stacks"]},
        duration_s=max(r["elapsed"] for r in reports), case_id=case_id, unfinished=tuple(hung),
    )


def _rejected_everywhere(outcome: CaseOutcome) -> bool:
    """Every rank raised the same error: no collective was left half-done, the group is reusable."""
    errors = list(outcome.errors.values())
    return (outcome.status == "error" and len(errors) == outcome.world_size
            and len({(e.type_name, e.message) for e in errors}) == 1)


def _external_problem(spec: PoolSpec, world_size: int) -> str:
    if spec.world_size != world_size:
        return (f"external launcher: world size is fixed at {world_size} by torchrun/SLURM "
                f"(WORLD_SIZE), but {spec} asks for {spec.world_size}")
    if spec.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return f"external launcher: {spec} needs a GPU, but none is visible on this node"
    return ""


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
