"""The rank side of a pool: one process per rank, serving the cases sent down its pipe.

A rank joins the process group, says Ready (or StartFailed, then exits), and then answers each
RunCase or HealthCheck with Returned or Raised (or HeldBack: runtime/agreement.py) until Stop or EOF,
and joins a held collective once on Release (runtime/protocol.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import gc
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from qgather.quiet import quiet_torchao
from qgather.runtime import whereabouts
from qgather.runtime.agreement import Agreement, HeldBackError
from qgather.runtime.lifeline import drop_inherited_helper_fds, watch_runner
from qgather.runtime.outcome import RankError
from qgather.runtime.protocol import (
    RUNNER_TO_RANK,
    HealthCheck,
    HeldBack,
    HeldWait,
    ProtocolError,
    Raised,
    Ready,
    Release,
    Returned,
    RunCase,
    StartFailed,
    Stop,
    decode,
    decode_case,
    encode,
    send,
)

_PR_SET_PDEATHSIG = 1


class CaseContext:
    """What a case function gets on each rank. Built inside the rank's process; never pickled."""

    def __init__(self, rank: int, world_size: int, backend: str, device: torch.device,
                 group: dist.ProcessGroup, seed: int, case_id: str,
                 mesh_factory: Callable[[], Any], kept: dict[str, Any] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.group = group
        self.seed = seed
        self.case_id = case_id
        self._mesh_factory = mesh_factory
        #: what a case leaves for the later cases of this rank process (e.g. its goldens,
        #: qgather.check.golden_cache), by its owner's key; lives as long as the pool
        self.kept = {} if kept is None else kept

    @property
    def mesh(self) -> Any:
        """A 1-D DeviceMesh over all ranks (for fully_shard), built on first use and cached."""
        return self._mesh_factory()

    def __repr__(self) -> str:
        return (f"CaseContext(rank={self.rank}, world_size={self.world_size}, backend={self.backend}, "
                f"device={self.device}, seed={self.seed}, case_id={self.case_id!r})")


@dataclass(frozen=True)
class RankConfig:
    """How one rank process sets itself up and joins its pool's process group."""

    rank: int
    world_size: int
    backend: str
    device: str
    store_path: str
    stacks_path: str
    env: dict[str, str]
    threads: int
    pg_timeout_s: float
    cpus: tuple[int, ...] = ()  # pin the rank to these CPUs (empty: leave it to the scheduler)
    runner_pid: int = 0  # the process that owns the pool: this rank ends when it is gone
    runner_start: int = 0  # its start time (clock ticks), so a reused pid is not mistaken for it
    pool_dir: str = ""  # removed by this rank if the runner dies first
    hold_collectives: bool = False  # qgather.runtime.agreement: where a new pool costs more than a hold


@dataclass
class _RankState:
    config: RankConfig
    device: torch.device
    group: dist.ProcessGroup
    meshes: dict[str, Any] = field(default_factory=dict)
    token: torch.Tensor = field(default_factory=lambda: torch.zeros(1))
    kept: dict[str, Any] = field(default_factory=dict)  # CaseContext.kept
    agreement: Agreement | None = None  # holds the case's collectives (config.hold_collectives)
    cases_since_full: int = 0  # _release_device_memory's count since its last full collection

    def barrier(self) -> None:
        """The rank's own barrier before each case (whereabouts.OWN_BARRIER: not a case's collective)."""
        # On gloo a one-element all_reduce synchronizes like dist.barrier() (no rank leaves before
        # every rank arrived) at half its cost; NCCL's barrier is already such an all_reduce.
        if self.config.backend == "gloo":
            dist.all_reduce(self.token)
        else:
            dist.barrier()

    def mesh(self) -> Any:
        """A 1-D DeviceMesh over the pool's ranks, made on first use."""
        if "world" not in self.meshes:
            self.meshes["world"] = init_device_mesh(self.device.type, (self.config.world_size,))
        return self.meshes["world"]


FULL_COLLECTION_EVERY = 64  # cases between collections that walk the frozen objects too
_keep_alive: list[Any] = []  # faulthandler writes to this file from a signal handler


def rank_main(config: RankConfig, conn: Connection, lifeline: Connection | None = None,
              where: Connection | None = None) -> None:
    """Entry point of a rank process: set up, join the process group, then serve cases.

    `lifeline` is the read end of a pipe only the runner can write to: EOF means it died.
    `where` answers the parent's "where is your case now?" (qgather.runtime.whereabouts).
    """
    phases = _StartPhases()
    _prepare_process(config, lifeline)
    if where is not None:
        whereabouts.serve(where)
    phases.lap("rank set-up")
    try:
        state = _join_group(config, phases)
    except BaseException as exc:  # report, then exit: the parent treats it as a failed start
        send(conn, encode(StartFailed(RankError.from_exception(config.rank, exc))))
        return
    # What the imports and the start made lives as long as the rank: no collection need walk it again.
    gc.freeze()
    send(conn, encode(Ready(os.getpid(), tuple(phases.seconds))))
    _serve(state, conn)


class _StartPhases:
    """The seconds of a rank's start, phase by phase (Ready.phases)."""

    def __init__(self) -> None:
        self.seconds: list[tuple[str, float]] = []
        self._since = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds.append((phase, now - self._since))
        self._since = now


def _prepare_process(config: RankConfig, lifeline: Connection | None) -> None:
    # A forkserver child inherits the forkserver's environment, not the parent's current one.
    os.environ.update(config.env)
    # torch.distributed reads TORCH_DISTRIBUTED_DEBUG once, at import: in the forkserver, before this env.
    dist.set_debug_level_from_env()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    quiet_torchao(summary=False)  # a rank that imports torchao would print its ~220 library warnings again
    drop_inherited_helper_fds()
    _die_with_parent()
    if config.runner_pid:
        watch_runner(lifeline, config.runner_pid, config.runner_start, config.pool_dir)
    stacks = open(config.stacks_path, "w")
    _keep_alive.append(stacks)
    faulthandler.enable(file=stacks, all_threads=True)
    # SIGTERM dumps every thread's stack, then terminates: the parent's abort doubles as a snapshot.
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    torch.set_num_threads(config.threads)
    if config.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, config.cpus)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if its parent dies: a backstop to the runner watchdog that
    works even while this rank holds the GIL in native code.

    The parent is the forkserver (which exits when the runner dies, see lifeline.py), or, with
    spawn, the thread that started the pool: under QGATHER_START_METHOD=spawn, start pools from a
    long-lived thread.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _bind_device(config: RankConfig) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    if torch.cuda._is_in_bad_fork():
        raise RuntimeError("this rank was forked from a process with CUDA initialized; "
                           "run with QGATHER_START_METHOD=spawn")
    index = config.rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _join_group(config: RankConfig, phases: _StartPhases) -> _RankState:
    device = _bind_device(config)
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the CUDA context, timed apart from the process group
    phases.lap("CUDA context")
    store = dist.FileStore(config.store_path, config.world_size)
    dist.init_process_group(
        config.backend, store=store, rank=config.rank, world_size=config.world_size,
        timeout=datetime.timedelta(seconds=config.pg_timeout_s),
        device_id=device if config.backend == "nccl" else None,
    )
    phases.lap("process group")
    dist.barrier()
    phases.lap("first barrier")
    agreement = Agreement(config.world_size, store, config.pg_timeout_s) if config.hold_collectives else None
    phases.lap("side group")
    return _RankState(config, device, dist.group.WORLD, agreement=agreement)


def _serve(state: _RankState, conn: Connection) -> None:
    """Answer the runner's messages until Stop or EOF; anything outside RUNNER_TO_RANK raises."""
    while True:
        try:
            data = conn.recv_bytes()  # blocks: no polling between cases
        except (EOFError, OSError):
            break  # the parent is gone
        match decode(data, RUNNER_TO_RANK):
            case Stop():
                break
            case RunCase() as message:
                reply = run_case_on_rank(state, message)
            case HealthCheck(sequence=sequence):
                reply = _health_check(state, sequence)
            case Release(waits=waits):
                _release(state, waits)
                continue  # the case was answered already: a release has no reply of its own
            case other:
                raise ProtocolError(f"rank {state.config.rank} cannot serve {type(other).__qualname__}")
        if not send(conn, reply):
            break
    dist.destroy_process_group()


def run_case_on_rank(state: _RankState, message: RunCase) -> bytes:
    """Barrier, seed, run the case function, and encode its reply (outcome.CASE_FRAME: this name is
    looked for in stacks)."""
    config = state.config
    whereabouts.NOTES.clear()
    try:
        if state.agreement is not None:
            state.agreement.next_case()
        fn, args = decode_case(message.blob)
        state.barrier()
        torch.manual_seed(message.seed)
        random.seed(message.seed)
        ctx = CaseContext(config.rank, config.world_size, config.backend, state.device, state.group,
                          message.seed, message.case_id, state.mesh, state.kept)
        with state.agreement.holding() if state.agreement is not None else contextlib.nullcontext():
            result = to_cpu(fn(ctx, *args))
    except HeldBackError as held:  # another rank failed: this one left its case instead of waiting
        return encode(HeldBack(held.collective))
    except BaseException as exc:  # the case's failure is data: report it, keep serving
        return encode(Raised(RankError.from_exception(config.rank, exc)))
    finally:
        _release_device_memory(state)
    try:
        return encode(Returned(result))
    except Exception as exc:
        error = RankError(config.rank, type(exc).__name__,
                          f"result of {getattr(fn, '__qualname__', fn)} is not picklable: {exc}")
        return encode(Raised(error))


def _release_device_memory(state: _RankState) -> None:
    """A sharded module holds reference cycles (FSDP2's hooks point back at it): without a
    collection its device buffers outlive the case, and a warm GPU rank's memory grows case by
    case. CPU ranks leave it to Python's own collector (a collection per case costs the suite time).

    A full collection walks every object the imports made (~300k with torch and TE: ~0.3 s, once per
    case on every rank). So the survivors are frozen after each collection, and the next one walks
    only what a case made; every FULL_COLLECTION_EVERY cases the frozen objects are thawed and walked
    too, so that a cycle which a later case let go of is collected all the same."""
    if state.device.type != "cuda":
        return
    state.cases_since_full += 1
    if state.cases_since_full >= FULL_COLLECTION_EVERY:
        state.cases_since_full = 0
        gc.unfreeze()
    gc.collect()
    gc.freeze()


def _release(state: _RankState, waits: tuple[HeldWait, ...]) -> None:
    """Join each held collective of this rank's groups that ranks still in the case wait at. Should it
    fail, the health check that follows every failed case finds the pool out of step, and the pool is
    replaced (a rank left waiting: the case ends as before, and the pool is aborted)."""
    if state.agreement is None:
        return
    for wait in waits:
        with contextlib.suppress(Exception):
            state.agreement.release(wait)


def _health_check(state: _RankState, sequence: int) -> bytes:
    """A collective every rank must complete after a failed case before the pool is trusted again."""
    try:
        mine = torch.tensor([sequence], device=state.device)
        gathered = [torch.zeros_like(mine) for _ in range(state.config.world_size)]
        dist.all_gather(gathered, mine)
        if any(int(t.item()) != sequence for t in gathered):
            raise RuntimeError(f"health check out of step: {[int(t.item()) for t in gathered]}")
        return encode(Returned(None))
    except BaseException as exc:
        return encode(Raised(RankError.from_exception(state.config.rank, exc)))


def to_cpu(value: Any) -> Any:
    """Move tensors in a (nested) result to the CPU, compacting views so only their data travels."""
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        tensor = value.detach().cpu()
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        return tensor
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(item) for item in value)
    return value

