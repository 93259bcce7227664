"""External launcher mode: every rank is already a process (torchrun, SLURM), pytest runs on each.

Every rank runs every case in step (same collection, same order). A case of N ranks runs on a
sub-group of N job ranks, intra-node or cross-node (see `placement`); the other ranks skip it but
still take part in agreeing on its outcome. There is no process to kill here, so each step is
bounded instead:

* start: every rank posts "at case k" to the job's store and waits (bounded) for all the others;
* run: the members run the case in-process on a group whose collectives time out just after the
  case timeout; a watchdog thread on each member snapshots its stacks and posts a HANG report at
  the timeout, or, once a peer has failed, posts "waiting" as soon as its case has sat inside a
  collective for WAIT_EVIDENCE_S; a case thread that never comes back ends its process;
* agree: each rank posts its report and waits (bounded) for everyone's; the first rank done (or
  timed out) fixes which reports count with a compare-and-set, so every rank merges the same
  reports into the same CaseOutcome. A rank with no report by then is lost: the job is unusable,
  every remaining rank says so, and the session stops with the same non-zero code everywhere.

Nothing here waits on a collective for the result exchange: the side channel is the job's
TCPStore (torchrun's agent store, or rank 0's), whose waits all take a timeout.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import pickle
import random
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from qgather.runtime import whereabouts
from qgather.runtime.launch import Launch, detect_launch, export_rendezvous
from qgather.runtime.outcome import CaseOutcome, OutcomeStatus, RankError, same_error_on_every_rank
from qgather.runtime.protocol import PICKLE_PROTOCOL, encode_case
from qgather.runtime.rank import CaseContext, to_cpu
from qgather.runtime.spec import PoolSpec, PoolSpecError, check_timeout

PG_MARGIN_S = 2.0  # a case group's collectives time out this long after the case timeout
REPORT_MARGIN_S = 5.0  # past the case timeout, a rank with no report is lost
HANG_GRACE_MIN_S = 10.0  # after posting HANG, a case thread gets max(this, timeout) to come back
START_MARGIN_S = 15.0
WHERE_POLL_S = 0.1
WAIT_EVIDENCE_S = 1.0  # as in RankPool: inside a collective this long after a peer failed = waiting for it
EXIT_SYNC_S = 60.0
LOST_EXIT_CODE = 1  # pytest's "tests failed": what the surviving ranks exit with too
PLACEMENTS = ("mixed", "intra", "cross")  # QGATHER_PLACEMENT


def external_world() -> tuple[int, int] | None:
    """(rank, world size) when a launcher started this process as one rank of a job, else None."""
    launch = detect_launch()
    return None if launch is None else (launch.rank, launch.world_size)


def local_rank() -> int:
    launch = detect_launch()
    return 0 if launch is None else launch.local_rank


def is_reporting_rank() -> bool:
    """True on the one process that should print (rank 0 of an external job, or a plain process)."""
    world = external_world()
    return world is None or world[0] == 0


def placement(size: int, nodes: list[str], case_id: str, policy: str = "mixed") -> tuple[tuple[int, ...], str]:
    """The job ranks a case of `size` ranks runs on, and "intra-node" or "cross-node".

    `nodes[r]` is job rank r's node. Where both kinds fit, `policy` picks: "intra", "cross", or
    "mixed" (by a hash of the case id, so a case id always lands on the same kind).
    """
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    groups = list(by_node.values())
    intra = next((tuple(ranks[:size]) for ranks in groups if len(ranks) >= size), None)
    spread = [r for column in range(max(map(len, groups))) for ranks in groups if column < len(ranks)
              for r in [ranks[column]]]
    cross = tuple(sorted(spread[:size])) if size > 1 and len(groups) > 1 else None
    if intra is None or (cross is not None and _prefers_cross(policy, case_id)):
        assert cross is not None
        return cross, "cross-node"
    return intra, "intra-node"


def _prefers_cross(policy: str, case_id: str) -> bool:
    if policy in ("intra", "cross"):
        return policy == "cross"
    return zlib.crc32(case_id.encode()) % 2 == 1


class _World:
    """The launcher's job as seen by this rank, shared by every ExternalPool of this process."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.host = launch.host
        self.owned = False
        self.broken = ""
        self.step = 0
        self.kv: Any = None  # a PrefixStore over the job's store
        self.nodes: list[str] = []
        self.hosts: list[str] = []
        self._start_wait_s = 0.0
        self._groups: dict[tuple, Any] = {}
        self._meshes: dict[tuple, Any] = {}
        self._retired: list[Any] = []  # groups left mid-collective: kept alive, never used again

    @property
    def joined(self) -> bool:
        return self.kv is not None

    def join(self, spec: PoolSpec) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if self.joined:
            return
        if not dist.is_initialized():
            export_rendezvous(self.launch)
            device = bind_device(spec)
            dist.init_process_group(spec.backend, init_method="env://", rank=self.rank, world_size=self.world_size,
                                    timeout=_timedelta(spec.startup_timeout_s),
                                    device_id=device if spec.backend == "nccl" else None)
            self.owned = True
        self.kv = dist.PrefixStore("qgather", distributed_c10d._get_default_store())
        self.kv.set(f"node/{self.rank}", f"{self.launch.node}\t{self.host}")
        keys = [f"node/{r}" for r in range(self.world_size)]
        missing = self._wait(keys, spec.startup_timeout_s)
        if missing:
            self.broken = f"job rank(s) {_ranks(missing)} never joined within {spec.startup_timeout_s:.0f} s"
            return
        self.nodes, self.hosts = zip(*(self.kv.get(k).decode().split("\t", 1) for k in keys))  # type: ignore
        self.nodes, self.hosts = list(self.nodes), list(self.hosts)
        self._start_wait_s = spec.startup_timeout_s

    # -- the store side channel ---------------------------------------------------------

    def _wait(self, keys: list[str], timeout: float) -> list[int]:
        """Wait (bounded) for keys ending in "/<rank>"; the ranks whose keys are still missing."""
        try:
            self.kv.wait(keys, _timedelta(max(timeout, 0.01)))
            return []
        except Exception:  # DistStoreError (a timeout) or the store itself gone
            try:
                return [int(k.rsplit("/", 1)[1]) for k in keys if not self.kv.check([k])]
            except Exception:
                return [int(k.rsplit("/", 1)[1]) for k in keys]

    def begin_case(self) -> int:
        """Every rank at the same case, or the job is broken (a rank died or never came back)."""
        self.step += 1
        step = self.step
        self.kv.set(f"c{step}/start/{self.rank}", "1")
        missing = self._wait([f"c{step}/start/{r}" for r in range(self.world_size)], self._start_wait_s)
        if missing:
            self.broken = (f"{self._who(missing)} did not reach the next case within {self._start_wait_s:.0f} s "
                           "(died, or stuck in the previous one)")
        else:
            self._forget(step - 1)
        return step

    def _forget(self, step: int) -> None:
        if step < 1:
            return
        keys = [f"c{step}/start/{self.rank}", f"c{step}/r/{self.rank}"]
        if self.rank == 0:
            keys += [f"c{step}/decision", f"c{step}/failed"]
        for key in keys:
            self.kv.delete_key(key)

    def post(self, step: int, report: dict[str, Any]) -> None:
        """This rank's report for the case; the first one posted counts (the watchdog's or the case's)."""
        self.kv.compare_set(f"c{step}/r/{self.rank}", "", pickle.dumps(report, protocol=PICKLE_PROTOCOL))
        if report.get("error") is not None:
            self.kv.set(f"c{step}/failed", "1")

    def peer_failed(self, step: int) -> bool:
        return bool(self.kv.check([f"c{step}/failed"]))

    def collect(self, step: int, deadline: float) -> dict[int, dict[str, Any]]:
        """Every rank's report, the same set on every rank: the first rank done fixes which count."""
        keys = [f"c{step}/r/{r}" for r in range(self.world_size)]
        missing = self._wait(keys, deadline - time.monotonic())
        present = [r for r in range(self.world_size) if r not in missing]
        decided = json.loads(self.kv.compare_set(f"c{step}/decision", "", json.dumps(present)))
        return {r: pickle.loads(self.kv.get(keys[r])) for r in decided}

    def agree_exit(self, status: int) -> int:
        """The same exit code on every rank: the worst one (1 for a rank that never says)."""
        if self.broken:
            return max(status, LOST_EXIT_CODE)
        self.kv.set(f"exit/{self.rank}", str(status))
        keys = [f"exit/{r}" for r in range(self.world_size)]
        missing = self._wait(keys, EXIT_SYNC_S)
        codes = [int(self.kv.get(k)) for r, k in enumerate(keys) if r not in missing]
        self.kv.set(f"exit/read/{self.rank}", "1")
        if self.rank == 0:  # under srun rank 0 hosts the store: stay until everyone has read
            self._wait([f"exit/read/{r}" for r in range(self.world_size)], REPORT_MARGIN_S)
        return max(codes + ([LOST_EXIT_CODE] if missing else []))

    # -- groups -------------------------------------------------------------------------

    def case_group(self, backend: str, members: tuple[int, ...], limit: float) -> tuple[tuple, Any]:
        """A process group over `members`, made once per (backend, members, timeout) and reused.

        Every rank calls this for every case, in the same order: new_group needs all of them."""
        import torch.distributed as dist

        key = (backend, members, round(limit + PG_MARGIN_S, 3))
        if key not in self._groups:
            self._groups[key] = dist.new_group(ranks=list(members), backend=backend,
                                               timeout=_timedelta(limit + PG_MARGIN_S))
        return key, self._groups[key]

    def mesh(self, key: tuple, device: Any) -> Any:
        if key not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self._meshes[key] = DeviceMesh.from_group(self._groups[key], device.type)
        return self._meshes[key]

    def retire(self, key: tuple) -> None:
        """A group some rank left mid-collective is out of step: the next case gets a new one."""
        if key in self._groups:
            self._retired.append(self._groups.pop(key))
        self._meshes.pop(key, None)

    def _who(self, ranks: list[int]) -> str:
        return ", ".join(f"job rank {r} ({self.hosts[r] if r < len(self.hosts) else '?'})" for r in ranks)

    def close(self) -> None:
        """Destroy the process group if this runtime created it (at shutdown, on every rank)."""
        import torch.distributed as dist

        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        self.owned, self.kv, self._groups, self._meshes, self._retired = False, None, {}, {}, []


_world: _World | None = None


def _shared_world(launch: Launch) -> _World:
    global _world
    if _world is None:
        _world = _World(launch)
    return _world


def world_broken() -> str:
    """Why the launched job can run no more cases ("" while it can)."""
    return _world.broken if _world is not None else ""


def agree_exit_status(status: int) -> int:
    """Under a launcher, the exit code every rank agrees on; otherwise `status`."""
    if _world is None or not _world.joined:
        return status
    return _world.agree_exit(status)


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
        launch = detect_launch()
        if launch is None or (launch.rank, launch.world_size) != (rank, world_size):
            launch = Launch("torchrun", rank, world_size, 0, world_size, "0", "", "")
        self._world = _shared_world(launch)

    @property
    def rank(self) -> int:
        return self._world.rank

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            case_id: str = "", seed: int = 0) -> CaseOutcome:
        encode_case(fn, args)  # the same one-line error as a RankPool for an unsendable case
        limit = check_timeout(timeout, self.spec.case_timeout_s)
        world = self._world
        if not world.broken:
            world.join(self.spec)
        if not world.broken:
            step = world.begin_case()
        if world.broken:
            return self._unusable(case_id)
        members, kind = placement(self.spec.world_size, world.nodes, case_id,
                                  os.environ.get("QGATHER_PLACEMENT", "mixed"))
        key, group = world.case_group(self.spec.backend, members, limit)
        start = time.monotonic()
        mine = (self._run_here(step, fn, args, limit, case_id, seed, members, key, group)
                if world.rank in members else {"state": "idle", "error": None})
        mine.update(job_rank=world.rank, host=world.host, elapsed=time.monotonic() - start)
        world.post(step, mine)
        reports = world.collect(step, start + limit + REPORT_MARGIN_S)
        outcome = _merge(reports, members, kind, world.hosts, case_id)
        if outcome.status is not OutcomeStatus.OK and not _rejected_everywhere(outcome):
            world.retire(key)
        # The next case waits for a rank whose case thread is late (hung, or in a collective that times out).
        world._start_wait_s = limit + max(limit, HANG_GRACE_MIN_S) + PG_MARGIN_S + START_MARGIN_S
        lost = [r for r in range(world.world_size) if r not in reports]
        if lost:
            world.broken = f"case {case_id!r}: {world._who(lost)} sent no report within {limit + REPORT_MARGIN_S:.0f} s"
        self._say_own_failure(mine, outcome, case_id)
        return outcome

    def shutdown(self) -> None:
        """The launcher owns the processes; only the process group this runtime made goes."""
        self._world.close()

    def _unusable(self, case_id: str) -> CaseOutcome:
        return CaseOutcome(OutcomeStatus.CRASH, [None] * self.spec.world_size, case_id=case_id,
                           note=f"the launched job is unusable: {self._world.broken}")

    def _run_here(self, step: int, fn: Callable[..., Any], args: tuple[Any, ...], limit: float, case_id: str,
                  seed: int, members: tuple[int, ...], key: tuple, group: Any) -> dict[str, Any]:
        world = self._world
        watchdog = _Watchdog(world, step, limit, max(limit, HANG_GRACE_MIN_S), case_id)
        watchdog.start()
        try:
            report = run_case_on_rank(self, fn, args, seed, case_id, members, key, group)
        finally:
            watchdog.finish()
        report["state"] = "done"
        return report

    def _say_own_failure(self, mine: dict[str, Any], outcome: CaseOutcome, case_id: str) -> None:
        """Ranks other than 0 print nothing, except their own failure (rank 0's is in the report)."""
        if self.rank == 0 or outcome.ok or _rejected_everywhere(outcome):
            return
        error = mine.get("error")
        what = (f"raised {error.first_line()}\n{error.traceback_text}" if error is not None
                else f"{mine.get('state')}" + (f"; stacks:\n{mine['stacks']}" if mine.get("stacks") else ""))
        if error is None and mine.get("state") in ("done", "idle"):
            return
        say(f"qgather: job rank {self.rank} on {self._world.host}: case {case_id}: {what}")


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


#: Where a rank's own failure is written; pytest's plugin points it past its output capture.
say: Callable[[str], None] = _to_stderr


def run_case_on_rank(pool: ExternalPool, fn: Callable[..., Any], args: tuple[Any, ...], seed: int, case_id: str,
                     members: tuple[int, ...], key: tuple, group: Any) -> dict[str, Any]:
    """Barrier, seed, run the case on this rank (outcome.CASE_FRAME: this name is looked for in stacks)."""
    import torch

    spec, world = pool.spec, pool._world
    rank = members.index(world.rank)
    try:
        device = bind_device(spec)
        barrier(group)
        torch.manual_seed(seed)
        random.seed(seed)
        ctx = CaseContext(rank, len(members), spec.backend, device, group, seed, case_id,
                          lambda: world.mesh(key, device))
        result = to_cpu(fn(ctx, *args))
        pickle.dumps(result, protocol=PICKLE_PROTOCOL)  # fail here, as this rank's error
        return {"result": result, "error": None}
    except Exception as exc:  # not BaseException: Ctrl-C must still stop pytest on this rank
        return {"result": None, "error": RankError.from_exception(rank, exc)}


def barrier(group: Any) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)


class _Watchdog(threading.Thread):
    """Posts this rank's report when the case cannot: at the timeout (HANG, with every thread's
    stack), or as soon as it is seen waiting in a collective for a peer that failed. A case
    thread that does not come back within `grace` after that ends the process."""

    def __init__(self, world: _World, step: int, timeout: float, grace: float, case_id: str) -> None:
        super().__init__(name="qgather-watchdog", daemon=True)
        self.world, self.step, self.timeout, self.grace, self.case_id = world, step, timeout, grace, case_id
        self.case_thread = threading.get_ident()
        self._done = threading.Event()

    def run(self) -> None:
        state = self._watch()
        if state is None:
            return
        stacks = _dump_stacks()
        self.world.post(self.step, {"state": state, "error": None, "stacks": stacks, "job_rank": self.world.rank,
                                    "host": self.world.host, "elapsed": self.timeout})
        if self._done.wait(self.grace):
            return
        print(f"qgather: job rank {self.world.rank} on {self.world.host}: case {self.case_id!r} still blocked "
              f"{self.grace:.0f} s after it was reported {state}; exiting with code {LOST_EXIT_CODE}. "
              f"Stacks:\n{stacks}", file=sys.stderr, flush=True)
        os._exit(LOST_EXIT_CODE)

    def _watch(self) -> str | None:
        """None when the case returned; else "hang" or "waiting"."""
        deadline = time.monotonic() + self.timeout
        waiting_since: float | None = None
        while not self._done.wait(min(WHERE_POLL_S, max(0.0, deadline - time.monotonic()))):
            now = time.monotonic()
            if now >= deadline:
                return "hang"
            if not self.world.peer_failed(self.step):
                continue
            if whereabouts.in_collective(whereabouts.frames_of(self.case_thread)) is None:
                waiting_since = None
            elif waiting_since is None:
                waiting_since = now
            elif now - waiting_since >= WAIT_EVIDENCE_S:
                return "waiting"
        return None

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=5.0)


def _dump_stacks() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _merge(reports: dict[int, dict[str, Any]], members: tuple[int, ...], kind: str, hosts: list[str],
           case_id: str) -> CaseOutcome:
    """The case's outcome over its group (indexed by group rank), the same on every job rank."""
    size = len(members)
    results: list[Any] = [None] * size
    errors: dict[int, RankError] = {}
    stacks: dict[int, str] = {}
    unfinished, lost, hung = [], [], False
    for g, r in enumerate(members):
        report = reports.get(r)
        if report is None:
            lost.append(g)
        elif report["state"] in ("hang", "waiting"):
            unfinished.append(g)
            stacks[g] = report["stacks"]
            hung = hung or report["state"] == "hang"
        elif report["error"] is not None:
            errors[g] = report["error"]
        else:
            results[g] = report["result"]
    status = (OutcomeStatus.CRASH if lost else OutcomeStatus.HANG if hung
              else OutcomeStatus.ERROR if errors else OutcomeStatus.OK)
    elapsed = [reports[r]["elapsed"] for r in members if r in reports] or [0.0]
    note = "; ".join(f"rank {g} (job rank {members[g]} on {hosts[members[g]]}) sent no report" for g in lost)
    return CaseOutcome(status=status, results=results, errors=errors, stacks=stacks, duration_s=max(elapsed),
                       case_id=case_id, unfinished=tuple(unfinished + lost), note=note, placement=kind,
                       job_ranks=members, hosts=tuple(hosts[r] for r in members))


def _rejected_everywhere(outcome: CaseOutcome) -> bool:
    """Every rank raised the same error: no collective was left half-done, the group is reusable."""
    return outcome.status is OutcomeStatus.ERROR and same_error_on_every_rank(outcome.errors,
                                                                              outcome.world_size) is not None


def _external_problem(spec: PoolSpec, world_size: int) -> str:
    if spec.world_size > world_size:
        return (f"external launcher: world size is fixed at {world_size} by torchrun/SLURM "
                f"(WORLD_SIZE), but {spec} asks for {spec.world_size}")
    if spec.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return f"external launcher: {spec} needs a GPU, but none is visible on this node"
    return ""


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
