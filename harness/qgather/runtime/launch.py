"""Is this process one rank of a job started by torchrun or SLURM, and where does the job meet?

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node) and
MASTER_ADDR/PORT. `srun python -m pytest ...` exports only SLURM's own numbering: SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, SLURM_NODEID; the meeting point is then
MASTER_ADDR (else SLURM_LAUNCH_NODE_IPADDR, else the first host of SLURM_JOB_NODELIST) and
MASTER_PORT (else derived from SLURM_JOB_ID, so every task of the job picks the same one).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

SLURM_PORT_BASE, SLURM_PORT_SPAN = 12000, 20000  # below Linux's ephemeral range (32768-60999)


@dataclass(frozen=True)
class Launch:
    """This process as one rank of a launched job: its numbering, its node and the job's meeting point."""

    kind: str  # "torchrun" | "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: str  # the node's id within the job (torchrun GROUP_RANK, SLURM_NODEID), else the host name
    master_addr: str
    master_port: str

    @property
    def host(self) -> str:
        """This machine's host name (for reports: which host a job rank ran on)."""
        return socket.gethostname()


def detect_launch(env: Mapping[str, str] | None = None) -> Launch | None:
    """The launcher's view of this process, or None for a plain process."""
    env = os.environ if env is None else env
    rendezvous = "MASTER_ADDR" in env and "MASTER_PORT" in env
    if "RANK" in env and "WORLD_SIZE" in env and (rendezvous or "TORCHELASTIC_RUN_ID" in env):
        world = int(env["WORLD_SIZE"])
        return Launch("torchrun", int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")),
                      int(env.get("LOCAL_WORLD_SIZE", str(world))), env.get("GROUP_RANK", socket.gethostname()),
                      env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""))
    # srun sets SLURM_STEP_ID; a batch script's own shell (SLURM_PROCID=0 there too) does not.
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 \
            and (rendezvous or "SLURM_STEP_ID" in env or "MASTER_ADDR" in env):
        world = int(env["SLURM_NTASKS"])
        per_node = _leading_int(env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"), world)
        return Launch("slurm", int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", "0")), per_node,
                      env.get("SLURM_NODEID", socket.gethostname()), slurm_master_addr(env), slurm_master_port(env))
    return None


def external_world() -> tuple[int, int] | None:
    """(rank, world size) when a launcher started this process as one rank of a job, else None."""
    launch = detect_launch()
    return None if launch is None else (launch.rank, launch.world_size)


def local_rank() -> int:
    """This process's rank on its node under a launcher (0 for a plain process)."""
    launch = detect_launch()
    return 0 if launch is None else launch.local_rank


def is_reporting_rank() -> bool:
    """True on the one process that should print (rank 0 of an external job, or a plain process)."""
    world = external_world()
    return world is None or world[0] == 0


def slurm_master_addr(env: Mapping[str, str]) -> str:
    """Where a SLURM job meets: MASTER_ADDR, else SLURM_LAUNCH_NODE_IPADDR, else the first host listed."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return first_host(nodelist) or "127.0.0.1"


def slurm_master_port(env: Mapping[str, str]) -> str:
    """MASTER_PORT, else one derived from SLURM_JOB_ID (the same on every task of the job)."""
    if env.get("MASTER_PORT"):
        return env["MASTER_PORT"]
    job = env.get("SLURM_JOB_ID", "")
    return str(SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN) if job.isdigit() else "29500"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: "gpu[07-09,12],cpu1" -> "gpu07"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return ""
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def export_rendezvous(launch: Launch) -> None:
    """Make env:// init see the meeting point (SLURM alone does not export it)."""
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", launch.master_port)


def default_world_sizes(job_size: int) -> list[int]:
    """1, 2, 4, ... up to the job's size, plus the job's size."""
    sizes, size = [], 1
    while size <= job_size:
        sizes.append(size)
        size *= 2
    return sorted({*sizes, job_size})


def _leading_int(text: str | None, default: int) -> int:
    match = re.match(r"\d+", text or "")
    return int(match.group()) if match else default
