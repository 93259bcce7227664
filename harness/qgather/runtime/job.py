"""A launched job (torchrun, SLURM) as one rank sees it: the job's store as a bounded side channel,
the sub-groups cases run on, and where a case of N ranks is placed among the job's ranks.

Every rank calls into a `JobWorld` for every case in the same order (same collection, same order):

* `begin_case`: each rank posts "at case k" to the store and waits (bounded) for all the others;
* `case_group`: a process group over the case's members, made once and reused (new_group needs
  every rank of the job, members or not);
* `post` / `collect`: each rank posts its RankReport and waits (bounded) for everyone's; the first
  rank done (or timed out) fixes which reports count with a compare-and-set, so every rank merges
  the same reports;
* `agree_exit`: at the end, the same exit code on every rank.

Nothing here waits on a collective for the result exchange: every wait on the store takes a timeout.
"""

from __future__ import annotations

import datetime
import json
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh

from qgather.runtime.launch import Launch, export_rendezvous, local_rank
from qgather.runtime.protocol import JOB_REPORTS, RankReport, decode, encode
from qgather.runtime.spec import PoolSpec

PG_MARGIN_S = 2.0  # a case group's collectives time out this long after the case timeout
REPORT_MARGIN_S = 5.0  # past the case timeout, a rank with no report is lost
EXIT_SYNC_S = 60.0
LOST_EXIT_CODE = 1  # pytest's "tests failed": what the surviving ranks exit with too
PLACEMENTS = ("mixed", "intra", "cross")  # QGATHER_PLACEMENT


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


def bind_device(spec: PoolSpec) -> torch.device:
    """This rank's device for `spec`: the CPU, or the GPU of its local rank (round-robin)."""
    if spec.device == "cpu":
        return torch.device("cpu")
    index = local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class JobWorld:
    """The launcher's job as seen by this rank, shared by every ExternalPool of this process."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.rank = launch.rank
        self.world_size = launch.world_size
        self.host = launch.host
        self.owned = False
        self.broken = ""  # why the job can run no more cases ("" while it can)
        self.step = 0
        self.kv: Any = None  # a PrefixStore over the job's store
        self.nodes: list[str] = []
        self.hosts: list[str] = []
        self.start_wait_s = 0.0  # how long begin_case waits for every rank to arrive
        self._groups: dict[tuple, Any] = {}
        self._meshes: dict[tuple, Any] = {}
        self._retired: list[Any] = []  # groups left mid-collective: kept alive, never used again

    @property
    def joined(self) -> bool:
        """Whether this rank met the others on the job's store."""
        return self.kv is not None

    def join(self, spec: PoolSpec) -> None:
        """Join the job's process group (unless the launcher's script did) and learn every rank's node."""
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
        self.start_wait_s = spec.startup_timeout_s

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
        missing = self._wait([f"c{step}/start/{r}" for r in range(self.world_size)], self.start_wait_s)
        if missing:
            self.broken = (f"{self.who(missing)} did not reach the next case within {self.start_wait_s:.0f} s "
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

    def post(self, step: int, report: RankReport) -> None:
        """This rank's report for the case; the first one posted counts (the watchdog's or the case's)."""
        self.kv.compare_set(f"c{step}/r/{self.rank}", "", encode(report))
        if report.error is not None:
            self.kv.set(f"c{step}/failed", "1")

    def peer_failed(self, step: int) -> bool:
        """Whether some rank posted an error for the case."""
        return bool(self.kv.check([f"c{step}/failed"]))

    def collect(self, step: int, deadline: float) -> dict[int, RankReport]:
        """Every rank's report, the same set on every rank: the first rank done fixes which count."""
        keys = [f"c{step}/r/{r}" for r in range(self.world_size)]
        missing = self._wait(keys, deadline - time.monotonic())
        present = [r for r in range(self.world_size) if r not in missing]
        decided = json.loads(self.kv.compare_set(f"c{step}/decision", "", json.dumps(present)))
        return {r: decode(self.kv.get(keys[r]), JOB_REPORTS) for r in decided}

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
        key = (backend, members, round(limit + PG_MARGIN_S, 3))
        if key not in self._groups:
            self._groups[key] = dist.new_group(ranks=list(members), backend=backend,
                                               timeout=_timedelta(limit + PG_MARGIN_S))
        return key, self._groups[key]

    def mesh(self, key: tuple, device: torch.device) -> DeviceMesh:
        """A 1-D DeviceMesh over the case group `key`, made once."""
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(self._groups[key], device.type)
        return self._meshes[key]

    def retire(self, key: tuple) -> None:
        """A group some rank left mid-collective is out of step: the next case gets a new one."""
        if key in self._groups:
            self._retired.append(self._groups.pop(key))
        self._meshes.pop(key, None)

    def who(self, ranks: list[int]) -> str:
        """Each of `ranks` as "job rank R (host)", comma-separated."""
        return ", ".join(f"job rank {r} ({self.hosts[r] if r < len(self.hosts) else '?'})" for r in ranks)

    def close(self) -> None:
        """Destroy the process group if this runtime created it (at shutdown, on every rank)."""
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        self.owned, self.kv, self._groups, self._meshes, self._retired = False, None, {}, {}, []


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
