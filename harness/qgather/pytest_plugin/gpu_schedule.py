"""The GPU job's scheduling: which xdist worker runs which cases, and when a worker gives GPUs back.

On a host with G GPUs every case whose pools fit in G runs on NCCL, one GPU per rank, each pool
leasing its GPUs for as long as it lives (qgather.runtime.gpu_lease). Three rules keep the GPUs busy
and the pools warm:

* Cases are handed to workers in units of up to CHUNK cases that need the same number of GPUs
  (their largest pool); a worker is given a unit of the size it ran last while there is one (its
  pool stays warm), else the largest that fits in the GPUs the other workers are not using, else a
  unit that needs no GPU of its own (gloo, the virtual scenario, other tests), else the smallest
  (it waits for its lease, which is fair and bounded).
* After each test a worker stops the NCCL pools that the next test it runs will not use, so a
  worker never sits on GPUs it no longer needs.
* Before a pool waits for GPUs, its process stops its own other NCCL pools (the registry), so no
  process waits while holding GPUs.

The run's controller makes the lease directory that every worker shares (QGATHER_GPU_LEASE_DIR).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from typing import Any

import pytest

from qgather.model.case import CaseSpec
from qgather.pytest_plugin.collection import case_in
from qgather.runtime import gpu_lease
from qgather.runtime.registry import release_gpu_pools
from qgather.runtime.spec import PoolSpec, visible_gpus

CHUNK = 16  # cases a worker is handed at once; its pool stays warm across them
FREE = 0  # the GPU need of a unit whose cases lease no GPU
lease_dir_key = pytest.StashKey[str]()


def gpu_need(case: CaseSpec, gpus: int) -> int:
    """GPUs the case's largest NCCL pool leases on a host with `gpus` GPUs (FREE: none)."""
    return max((size for size in case.pool_sizes if size <= gpus), default=FREE)


def make_lease_dir(config: pytest.Config) -> None:
    """The controller's lease directory, inherited by the workers it starts (none for a CPU run)."""
    if gpu_lease.LEASE_DIR_ENV in os.environ or not visible_gpus():
        return
    directory = gpu_lease.make_lease_dir()
    os.environ[gpu_lease.LEASE_DIR_ENV] = directory
    config.stash[lease_dir_key] = directory


def remove_lease_dir(config: pytest.Config) -> None:
    directory = config.stash.get(lease_dir_key, None)
    if directory is not None:
        del config.stash[lease_dir_key]
        os.environ.pop(gpu_lease.LEASE_DIR_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)


def release_after(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the NCCL pools that `nextitem` will not use (all of them when it is not a case)."""
    case = getattr(getattr(nextitem, "callspec", None), "params", {}).get("case") if nextitem else None
    sizes = case.pool_sizes if isinstance(case, CaseSpec) else ()
    release_gpu_pools(keep=[PoolSpec("nccl", size, "cuda") for size in sizes])


def scheduler_for(config: pytest.Config, log: Any, device: str) -> Any:
    """The xdist scheduler of a GPU job (--device cuda, --dist load, GPUs visible); None: xdist's own."""
    gpus = len(visible_gpus()) if device == "cuda" else 0
    if not gpus or config.getoption("dist", "load") != "load":
        return None
    from qgather.pytest_plugin.gpu_scheduler import GpuScheduling  # imports xdist's scheduler classes

    return GpuScheduling(config, log, gpus)


def unit_needs(nodeids: list[str], gpus: int) -> dict[str, tuple[str, int]]:
    """nodeid -> (unit, its GPU need): runs of up to CHUNK cases of one need, in collection order."""
    seen: Counter[int] = Counter()
    units = {}
    for nodeid in nodeids:
        case = case_in(nodeid)
        need = gpu_need(case, gpus) if case is not None else FREE
        units[nodeid] = (f"qgather-gpus{need}-{seen[need] // CHUNK}", need)
        seen[need] += 1
    return units
