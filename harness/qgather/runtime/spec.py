"""What a pool is (backend, world size, device), how it is checked, and the GPUs it may use."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from qgather.errors import UsageError
from qgather.runtime.launch import detect_launch

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")

# Case timeouts by backend: NCCL cases pay kernel launches, allocator warm-up and communicator
# setup on their first collective, so they get more room than gloo on CPU.
DEFAULT_CASE_TIMEOUT_S = {("gloo", "cpu"): 60.0, ("gloo", "cuda"): 90.0, ("nccl", "cuda"): 120.0}
DEFAULT_STARTUP_TIMEOUT_S = {("gloo", "cpu"): 120.0, ("gloo", "cuda"): 180.0, ("nccl", "cuda"): 300.0}

# The GPU host needs NVLink multicast off; an explicit setting in the environment wins.
RANK_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class PoolSpecError(UsageError):
    """A pool that cannot exist here; the message is one line that says why."""


@dataclass(frozen=True)
class PoolSpec:
    """What a pool is: its backend ("gloo" | "nccl"), number of ranks and device ("cpu" | "cuda")."""

    backend: str = "gloo"
    world_size: int = 2
    device: str = "cpu"

    def validate(self) -> PoolSpec:
        """This spec, if a pool of it can run here; else PoolSpecError, one line saying why not."""
        problem = self._problem()
        if problem:
            raise PoolSpecError(f"{self}: {problem}")
        return self

    @property
    def holds_collectives(self) -> bool:
        """Whether a case's collectives are held until every rank is there (runtime/agreement.py): on
        CUDA, where replacing a pool whose ranks a failed rank left waiting costs seconds (contexts,
        communicators). Not on the CPU by default: there a held collective whose ranks hand it different
        sizes is an ERROR (UnequalCollectiveSizes) where gloo itself aborts the ranks (a CRASH), the verdict
        the standalone scripts reproduce (tests/test_standalone_agreement.py). QGATHER_HOLD_COLLECTIVES=1
        or 0 decides instead (=1 on the CPU: the torchao gate in 23.9 s against 62.3 s, 2026-11-29)."""
        chosen = os.environ.get("QGATHER_HOLD_COLLECTIVES", "")
        return chosen == "1" if chosen in ("0", "1") else self.device == "cuda"

    @property
    def restarts_in_background(self) -> bool:
        """Whether a pool that a failed case left without ranks starts them again at once, in the
        background (runtime/pool.py), rather than when its next case asks: on CUDA, where a start
        costs seconds (a CUDA context per rank; 8.6 s for the slowest rank of a start, on average,
        in the GPU gate on 2 x H200), so the next case finds it warm or nearly."""
        return self.device == "cuda"

    @property
    def key(self) -> tuple[str, str]:
        """(backend, device): what the default timeouts depend on."""
        return (self.backend, self.device)

    @property
    def case_timeout_s(self) -> float:
        """A case's default timeout on this backend and device."""
        return DEFAULT_CASE_TIMEOUT_S[self.key]

    @property
    def startup_timeout_s(self) -> float:
        """The bound on spawning the ranks and joining their process group."""
        return DEFAULT_STARTUP_TIMEOUT_S[self.key]

    @classmethod
    def auto(cls, world_size: int) -> PoolSpec:
        """NCCL with one rank per GPU when there are enough GPUs, else gloo (on CUDA if any)."""
        gpus = len(visible_gpus())
        if gpus >= world_size:
            return cls("nccl", world_size, "cuda")
        return cls("gloo", world_size, "cuda" if gpus else "cpu")

    def __str__(self) -> str:
        return f"PoolSpec({self.backend}, world_size={self.world_size}, device={self.device})"

    def _problem(self) -> str:
        problem = self.shape_problem()
        if problem or self.device != "cuda":
            return problem
        if detect_launch() is not None:  # ranks spread over the job's nodes: ExternalPool checks its own node
            return ""
        return _gpu_problem(self.backend, self.world_size, len(visible_gpus()))

    def shape_problem(self) -> str:
        """What is wrong with the spec itself, whatever the hardware ("" if nothing)."""
        if self.backend not in BACKENDS:
            return f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}"
        if self.device not in DEVICES:
            return f"unknown device {self.device!r}; choose from {', '.join(DEVICES)}"
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool):
            return f"world size must be an int, got {type(self.world_size).__name__}"
        if self.world_size < 1:
            return f"world size must be >= 1, got {self.world_size}"
        if self.backend == "nccl" and self.device != "cuda":
            return "nccl needs device='cuda'"
        return ""


def _gpu_problem(backend: str, world_size: int, gpus: int) -> str:
    if gpus == 0:
        return f"{backend} on cuda needs a GPU, but none is visible"
    if backend == "nccl" and world_size > gpus:
        return (f"nccl runs one rank per GPU: {world_size} ranks but {gpus} visible GPU(s); "
                "use gloo on cuda for more ranks than GPUs")
    return ""


def _xdist_slot() -> tuple[int, int]:
    """(number of pytest-xdist workers, this worker's index); (1, 0) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (name.startswith("gw") and name[2:].isdigit() and count.isdigit()):
        return 1, 0
    return max(1, int(count)), int(name[2:])


def _parent_gpu_names() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries for a child process."""
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver: no GPUs, rather than no pools at all
        count = 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def visible_gpus() -> list[str]:
    """The host's GPUs as the caller sees them (CUDA_VISIBLE_DEVICES entries, for the ranks' own).

    Every process of a run sees all of them: an NCCL pool leases the GPUs it runs on
    (qgather.runtime.gpu_lease), so pytest-xdist workers share the host without sharing a GPU.
    """
    return _parent_gpu_names()


def check_timeout(timeout: float | None, default: float) -> float:
    """A case timeout in seconds: `default` for None, else a positive finite number (ValueError otherwise)."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def rank_env(spec: PoolSpec, threads: int, gpus: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """Environment for a pool's ranks: the parent's, plus what the runtime needs; `gpus`: the
    CUDA_VISIBLE_DEVICES entries its ranks run on (rank r on the r-th, modulo their number),
    by default every visible GPU (gloo on CUDA shares them)."""
    env = dict(os.environ)
    for name, value in RANK_ENV_DEFAULTS.items():
        env.setdefault(name, value)
    # All ranks of a pool are local; loopback avoids hosts whose hostname resolves to nothing usable.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = str(threads)
    if spec.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus or visible_gpus())
    return env


def threads_per_rank(world_size: int) -> int:
    """Torch threads per rank: this process's share of the CPUs (under xdist) over its ranks."""
    count, _ = _xdist_slot()
    return max(1, (os.cpu_count() or 1) // (world_size * count))


def rank_cpus(spec: PoolSpec) -> list[tuple[int, ...]]:
    """A disjoint CPU slice per CPU rank (wrapping round when ranks outnumber CPUs).

    On a small machine the ranks outnumber the cores, and letting the scheduler migrate their
    gloo threads costs more than the collectives themselves. GPU ranks are left alone (their
    NUMA placement is the GPU's business); QGATHER_PIN_CPUS=0 turns pinning off.
    """
    if spec.device != "cpu" or os.environ.get("QGATHER_PIN_CPUS", "1") == "0" \
            or not hasattr(os, "sched_getaffinity"):
        return [()] * spec.world_size
    allowed = sorted(os.sched_getaffinity(0))
    count, index = _xdist_slot()
    per_rank = max(1, len(allowed) // (spec.world_size * count))
    slots = []
    for rank in range(spec.world_size):
        first = (index * spec.world_size + rank) * per_rank
        slots.append(tuple(allowed[(first + i) % len(allowed)] for i in range(per_rank)))
    return slots
