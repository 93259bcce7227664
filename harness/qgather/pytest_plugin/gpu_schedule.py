"""The GPU job's sharing of its GPUs: how many ranks one GPU seats, and when a worker's pools start and stop.

Every pytest-xdist worker sees every GPU, and xdist hands out the cases one at a time as it does on the
CPU. A pool's ranks take seats on the GPUs (qgather.runtime.gpu_lease): K per GPU, from the tightest
GPU's free memory and the host's, over what one rank of the suite's largest case needs
(`plan_seats`; QGATHER_GPU_SEATS overrides). A worker keeps its pools for the whole run, whatever world
size its next case has; while another process of the run waits for seats, each process's yielder thread
stops its idle pools (qgather.runtime.registry). Pools start as the cases need them: every worker starting
every pool at once, tried on 2 x H200, made each start ~15 s and the first cases time out
(docs/gpu-results.md, 2026-11-28).

The run's controller makes the lease directory every worker shares (QGATHER_GPU_LEASE_DIR) and fixes K
(QGATHER_GPU_SEATS) before the workers start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from qgather.pytest_plugin.collection import preload_before_key
from qgather.runtime import gpu_lease
from qgather.runtime.helpers import COMPILE_WARMUP, mp_context, preload_for_run
from qgather.runtime.spec import visible_gpus
from qgather.suite.shape_space import MAX_ELEMENTS

GIB = 1 << 30
# One CUDA rank's own device memory beside its case: its context, cuBLAS's and NCCL's workspaces and
# TransformerEngine's, with room to spare. On the 1 x H200 gate (2026-11-29, docs/gpu-results.md) the GPU
# held 62 GB at 71 ranks (0.9 GB a rank, cases included; 0.95 GB in the TE gate): 1.5 GiB made K 71 there,
# which the run's pools, standbys and restarts filled, so that workers stopped each other's warm pools.
RANK_GPU_BYTES = 5 * GIB // 4
RANK_HOST_BYTES = GIB  # a rank's private host memory (torch, CUDA's host side); the rest is shared
# The largest weight of the suite in float32, held a few times over on a rank (the shard, the gathered
# weight, the golden, the one-device twin, the dequantized copies), at most this many times.
CASE_COPIES = 16
SHARE = 0.8  # of the free memory that the seats may plan on
FREE_MEMORY_TIMEOUT_S = 120.0
lease_dir_key = pytest.StashKey[str]()
seat_plan_key = pytest.StashKey["SeatPlan"]()


@dataclass(frozen=True)
class SeatPlan:
    """K, the seats per GPU, and what it was derived from (bytes; `source` says how)."""

    seats: int
    source: str  # "measured" | "QGATHER_GPU_SEATS" | "default: <why the memory could not be read>"
    gpu_free_bytes: tuple[int, ...] = ()
    host_available_bytes: int = 0
    per_rank_bytes: int = 0

    def describe(self) -> str:
        if self.source != "measured":
            return f"GPU seats: {self.seats} per GPU ({self.source})"
        return (f"GPU seats: {self.seats} per GPU (tightest GPU {min(self.gpu_free_bytes) / GIB:.1f} GiB free, "
                f"host {self.host_available_bytes / GIB:.0f} GiB available, {self.per_rank_bytes / GIB:.2f} GiB "
                f"per rank; {gpu_lease.SEATS_ENV} overrides)")


def plan_seats(gpu_free: list[int], host_available: int, largest_case_elements: int = MAX_ELEMENTS) -> SeatPlan:
    """K from the GPUs' free memory and the host's: the ranks that fit on the tightest GPU, and the
    ranks the host can carry spread over the GPUs, whichever is fewer (at least 1)."""
    per_rank = RANK_GPU_BYTES + CASE_COPIES * 4 * largest_case_elements
    by_gpu = int(SHARE * min(gpu_free)) // per_rank
    by_host = int(SHARE * host_available) // (RANK_HOST_BYTES * len(gpu_free))
    return SeatPlan(max(1, min(by_gpu, by_host)), "measured", tuple(gpu_free), host_available, per_rank)


def make_lease_dir(config: pytest.Config) -> None:
    """The controller's lease directory and K, inherited by the workers it starts (none for a CPU run)."""
    if gpu_lease.LEASE_DIR_ENV in os.environ or not visible_gpus():
        return
    directory = gpu_lease.make_lease_dir()
    os.environ[gpu_lease.LEASE_DIR_ENV] = directory
    config.stash[lease_dir_key] = directory
    plan = _seat_plan()
    os.environ[gpu_lease.SEATS_ENV] = str(plan.seats)
    config.stash[seat_plan_key] = plan


def _seat_plan() -> SeatPlan:
    if os.environ.get(gpu_lease.SEATS_ENV, "").strip():
        try:
            return SeatPlan(gpu_lease.seats_per_gpu(), gpu_lease.SEATS_ENV)
        except gpu_lease.SeatsError as exc:
            raise pytest.UsageError(str(exc)) from None
    free, problem = _gpu_free_bytes()
    if problem:
        return SeatPlan(gpu_lease.DEFAULT_SEATS, f"default: {problem}")
    return plan_seats(free, _host_available_bytes())


def _gpu_free_bytes() -> tuple[list[int], str]:
    """Each visible GPU's free memory, read in a child process (the controller keeps no CUDA context)."""
    code = ("import torch; print(' '.join(str(torch.cuda.mem_get_info(i)[0]) "
            "for i in range(torch.cuda.device_count())))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=FREE_MEMORY_TIMEOUT_S)
        free = [int(word) for word in done.stdout.split()]
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        return [], f"the GPUs' free memory could not be read ({type(exc).__name__})"
    if done.returncode != 0 or not free:
        return [], f"the GPUs' free memory could not be read (exit {done.returncode})"
    return free, ""


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) if hasattr(os, "sysconf") else 64 * GIB


def boot_forkserver_early(config: pytest.Config) -> None:
    """A GPU job's xdist worker launches the forkserver its pools' ranks fork from while it collects.

    The forkserver imports torch, TE and the compile warm-up before it forks a rank (~15 s while eight
    workers boot theirs at once: the first pool start of each worker on the 1 x H200 gate, 2026-11-29,
    was 18.6 s, 14.7 s of it this boot). Launching it returns at once; the imports run in the server
    meanwhile. The compile warm-up is preloaded whether or not the run compiles (which is only known
    once collected): the forkserver reads its preloads when it starts."""
    if gpu_lease.LEASE_DIR_ENV not in os.environ or preload_before_key in config.stash:
        return
    config.stash[preload_before_key] = preload_for_run([COMPILE_WARMUP])  # restored at pytest_unconfigure
    mp_context()


def remove_lease_dir(config: pytest.Config) -> None:
    directory = config.stash.get(lease_dir_key, None)
    if directory is not None:
        del config.stash[lease_dir_key]
        os.environ.pop(gpu_lease.LEASE_DIR_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)
    if seat_plan_key in config.stash:
        del config.stash[seat_plan_key]
        os.environ.pop(gpu_lease.SEATS_ENV, None)


def report_header(config: pytest.Config) -> list[str]:
    plan = config.stash.get(seat_plan_key, None)
    return [f"qgather: {plan.describe()}"] if plan is not None else []
