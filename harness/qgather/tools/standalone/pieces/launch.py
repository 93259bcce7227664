"""Running the ranks: under torchrun (NCCL on GPUs), or `python FILE`, which forks WORLD_SIZE
ranks itself (gloo on the CPU) and waits for all of them under one deadline, so that a rank that
raises, dies or hangs is reported as qgather reports it (ERROR, CRASH, HANG) instead of waited on."""

# ruff: noqa: F821 -- the script defines CASE, SHAPE, ..., and the other pieces' functions (see __init__)

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import wait

import torch
import torch.distributed as dist


def main() -> int:
    """Exit status: 0 when every rank gathered the golden's bytes, 1 with the evidence otherwise."""
    if "RANK" in os.environ:  # torchrun
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != WORLD_SIZE:
            print(f"this case runs at {WORLD_SIZE} ranks: torchrun --nproc-per-node {WORLD_SIZE} {sys.argv[0]}")
            return 2
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else None
        try:
            result = run_rank(rank, device, "nccl" if device is not None else "gloo", None)
        except Exception as exc:
            print(f"{CASE}: ERROR - rank {rank}: {type(exc).__name__}: {exc}", flush=True)
            raise  # torchrun stops the other ranks
        results = [None] * world_size
        dist.all_gather_object(results, result)
        dist.destroy_process_group()
        return report(*judge(results)) if rank == 0 else int(judge(results)[0] != "EXACT")
    return report(*spawn())


def run_rank(rank: int, device, backend: str, port) -> dict:
    """One rank: join the group, gather through the library's FSDP2 route, compare with the golden."""
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(WORLD_SIZE))
    if device is not None:
        torch.cuda.set_device(device)
    # a collective waits TIMEOUT_S at most (NCCL's watchdog then aborts the rank), under torchrun too
    dist.init_process_group(backend, rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    label, row0, got, want = gathered(rank, device or torch.device("cpu"))
    lines = compare(got, want, dequantize(got), dequantize(want), row0)
    return {"rank": rank, "label": label, "lines": lines, "digest": digest(got)}


def spawn() -> tuple[str, list[str]]:
    """WORLD_SIZE forked ranks; the verdict from what they sent, how they ended, or the deadline."""
    if LIBRARY_NEEDS_CUDA and torch.cuda.device_count() < WORLD_SIZE:
        return "SKIPPED", [f"needs {WORLD_SIZE} GPUs: torchrun --nproc-per-node {WORLD_SIZE} {sys.argv[0]}"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")  # works for `python FILE` and for exec(open(FILE).read())
    ranks, pending = [], {}
    for rank in range(WORLD_SIZE):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_rank_process, args=(rank, port, writer), daemon=True)
        process.start()
        writer.close()
        ranks.append(process)
        pending[process.sentinel] = (rank, reader)
    results, errors, deadline = {}, {}, time.monotonic() + TIMEOUT_S
    while pending and time.monotonic() < deadline:
        ready = set(wait([*pending, *(reader for _, reader in pending.values())], deadline - time.monotonic()))
        for sentinel, (rank, reader) in list(pending.items()):
            if sentinel not in ready and reader not in ready:
                continue
            del pending[sentinel]
            try:
                kind, value = reader.recv()
            except EOFError:  # the rank died before it could say anything
                kind, value = "died", None
            if kind != "ok":  # the others may wait in a collective for this rank: a short grace, not the timeout
                deadline = min(deadline, time.monotonic() + 5.0)
            if kind != "died":
                (results if kind == "ok" else errors)[rank] = value
    for process in ranks:
        process.join(timeout=1.0 if not pending else 0.0)
        if process.is_alive():
            process.kill()
            process.join()
    return _verdict(ranks, results, errors)


def _rank_process(rank: int, port: int, writer) -> None:
    device = torch.device("cuda", rank) if LIBRARY_NEEDS_CUDA else None
    try:
        writer.send(("ok", run_rank(rank, device, "nccl" if device is not None else "gloo", port)))
    except Exception as exc:  # noqa: BLE001 -- the script reports every rank's error
        first_line = (str(exc).strip().splitlines() or [""])[0]
        writer.send(("error", f"{type(exc).__name__}: {first_line}"))


def _verdict(ranks: list, results: dict, errors: dict) -> tuple[str, list[str]]:
    killed = [f"rank {r} killed by {signal.Signals(-p.exitcode).name}" for r, p in enumerate(ranks)
              if p.exitcode is not None and p.exitcode < 0 and p.exitcode != -signal.SIGKILL]
    if killed:
        return "CRASH", killed + [f"rank {r}: {e}" for r, e in errors.items()]
    if errors:  # in the order they came: the first is the root cause, the others its echoes
        return "ERROR", [f"rank {r}: {e}" for r, e in errors.items()]
    missing = [r for r in range(WORLD_SIZE) if r not in results]
    if missing:
        return "HANG", [f"ranks {', '.join(map(str, missing))} did not finish within {TIMEOUT_S} s"]
    return judge([results[r] for r in range(WORLD_SIZE)])


def report(verdict: str, lines: list[str]) -> int:
    """Print the verdict and its evidence, as qgather's report starts; the exit status (2: not run)."""
    print(f"{CASE}: {verdict}" + (f" - {lines[0]}" if lines else ""))
    for line in lines[1:]:
        print(f"  {line}")
    return {"EXACT": 0, "SKIPPED": 2}.get(verdict, 1)
