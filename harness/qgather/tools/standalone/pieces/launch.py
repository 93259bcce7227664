"""Running the ranks: under torchrun (NCCL on GPUs; gloo on CUDA with more ranks than GPUs), or
`python FILE`, which forks WORLD_SIZE gloo ranks on the CPU (`spawn`; SPAWN False: a GPU library's
script says in one line to use torchrun instead) and waits for all of them under one deadline, so that a rank
that raises, dies or hangs is reported as qgather reports it (ERROR, CRASH, HANG) instead of waited on.

REJECTED, under either launcher, as qgather's rule has it: every rank raised one of the library's
declared refusals (REFUSALS, qgather's `rejection_types`) with the same message up to numbers, before
any data moved (DATA_MOVED: set by FSDP2's first all-gather and by an optimizer step's write). Under
torchrun each rank that raised posts its refusal in torchrun's store and waits a short grace for the
others' (`refused_on_every_rank`); a rank waiting in a collective posts none, so that is an ERROR."""

# ruff: noqa: F821 -- the script defines CASE, WORLD_SIZE, ... and the other pieces' functions (see __init__)

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist


def main() -> int:
    """Exit status: 0 when every rank gathered the golden's bytes, 1 with the evidence otherwise."""
    if SPAWN:
        if "RANK" not in os.environ:  # python FILE
            return report(*spawn())
    if int(os.environ.get("WORLD_SIZE", 0)) != WORLD_SIZE:  # SPAWN False: python FILE too
        sys.exit(f"this case runs at {WORLD_SIZE} ranks: torchrun --nproc-per-node {WORLD_SIZE} {sys.argv[0]}")
    rank, gpus = int(os.environ["RANK"]), torch.cuda.device_count()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % gpus) if gpus else None
    deadline = threading.Timer(TIMEOUT_S, lambda: (print(f"{CASE}: HANG - rank {rank}: no result within "
                                                          f"{TIMEOUT_S} s (REPRO_TIMEOUT_S)", flush=True), os._exit(1)))
    deadline.daemon = True  # our own deadline: NCCL's watchdog does not always end a rank stuck in a collective
    deadline.start()
    try:
        stages = run_rank(rank, device, "nccl" if gpus >= WORLD_SIZE else "gloo")
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if REFUSALS:
            if refused_on_every_rank(rank, refusal(exc)):  # alike, before any data moved: REJECTED, exit 0
                return report("REJECTED", [refusal(exc)]) if rank == 0 else 0
        print(f"{CASE}: ERROR - rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        raise  # torchrun stops the other ranks
    dist.all_gather_object(every := [None] * WORLD_SIZE, stages)
    status = report(*verdict(every)) if rank == 0 else int(verdict(every)[0] != "EXACT")
    dist.barrier()  # rank 0 has printed before any rank exits: torchrun stops the others at the first exit 1
    dist.destroy_process_group()
    return status


def run_rank(rank: int, device, backend: str = "gloo") -> list[dict]:
    """One rank: join the group, run the scenario, each stage's evidence against the golden."""
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if REFUSALS:
        for name in [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]:
            setattr(dist, name, lambda *a, _gather=dist.__dict__[name], **k: (DATA_MOVED.set(), _gather(*a, **k))[1])
    if FLOAT8_WIRE:  # the library all-gathers float8 tensors, which gloo cannot
        if backend == "gloo":
            float8_as_bytes_on_gloo()
    return [{"rank": rank, "label": label, "lines": lines, "digest": digest}
            for label, lines, digest in gathered(rank, device or torch.device("cpu"))]


def refusal(exc: BaseException) -> str:
    """`Type: first line` of `exc` when it is one of REFUSALS ((class name, message prefix), matched
    against every class of the error) raised before any data moved; else ""."""
    if not REFUSALS:  # no error is a refusal of this case
        return ""
    said = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    names, message = {cls.__name__ for cls in type(exc).__mro__}, said.partition(": ")[2]
    return said if any(n in names and message.startswith(p) for n, p in REFUSALS) and not DATA_MOVED.is_set() else ""


def refused_on_every_rank(rank: int, refused: str) -> bool:
    """torchrun: whether every rank refused alike (each rank's `refusal`, posted in torchrun's store;
    a rank that posts none within a short grace is waiting in a collective: not every rank refused)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store.set(f"refused/{rank}", refused)
    with contextlib.suppress(RuntimeError):  # a rank posted nothing in the grace; alike: up to each rank's sizes
        store.wait(keys := [f"refused/{r}" for r in range(WORLD_SIZE)], datetime.timedelta(seconds=5))
        return len(alike := {re.sub(r"\d+", "N", store.get(key).decode()) for key in keys}) == 1 and "" not in alike
    return False


def verdict(every: list[list[dict]]) -> tuple[str, list[str]]:
    """The first stage that is not EXACT on every rank: one evidence line per finding, naming the
    ranks that share it (a rank of a checkpoint's saving world only has no stage)."""
    for stage in zip(*[stages for stages in every if stages]):
        found = {}
        for r in stage:
            found.setdefault((r["label"], *r["lines"]), []).append(r["rank"])
        shown = [f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {label}: {'; '.join(lines)}"
                 for (label, *lines), ranks in found.items() if lines]
        if len({(r["label"], r["digest"]) for r in stage}) > len({r["label"] for r in stage}):  # ranks of one piece
            return "RANK_DIVERGENCE", shown or ["ranks gathered different bytes"]  # gathered different bytes
        if shown:
            return "SILENT_MISMATCH", shown
    return "EXACT", []


def spawn() -> tuple[str, list[str]]:
    """WORLD_SIZE forked gloo ranks; the verdict from what they sent, how they ended, or the deadline."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    fork, ranks, readers = multiprocessing.get_context("fork"), [], {}  # fork: under exec(open(FILE).read()) too
    for rank in range(WORLD_SIZE):
        reader, writer = fork.Pipe(duplex=False)
        ranks.append(fork.Process(target=_rank, args=(rank, writer), daemon=True))
        ranks[-1].start(), writer.close()  # the reader sees EOF when the rank dies
        readers[reader] = rank
    sent, deadline = {}, time.monotonic() + TIMEOUT_S  # rank -> (kind, stages or error, its refusal)
    while readers and time.monotonic() < deadline:
        for reader in multiprocessing.connection.wait(list(readers), deadline - time.monotonic()):
            rank = readers.pop(reader)
            with contextlib.suppress(EOFError):  # EOF: it died before it could say anything
                sent[rank] = reader.recv()
            sent.setdefault(rank, ("died", "", ""))
            if sent[rank][0] != "ok":  # the others may wait for it in a collective: a short grace
                deadline = min(deadline, time.monotonic() + 5.0)
    for process in ranks:  # a rank still waiting is killed
        process.join(0 if readers else 1.0), process.kill(), process.join()
    died = [f"rank {r} killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"rank {r} exited with "
            f"status {p.exitcode}" for r, p in enumerate(ranks) if sent.get(r, ("",))[0] == "died"]  # the root cause
    failed = died + [f"rank {r}: {value}" for r, (kind, value, _) in sent.items() if kind == "error"]  # first
    if REFUSALS:  # every rank refused alike (up to each rank's sizes): rank 0's refusal, as qgather says it
        if len(alike := {re.sub(r"\d+", "N", sent[r][2]) if r in sent else "" for r in range(WORLD_SIZE)}) == 1:
            if "" not in alike:
                return "REJECTED", [sent[0][2]]
    if failed or readers:
        return ("CRASH" if died else "ERROR" if failed else "HANG"), failed or [
            f"ranks {sorted(readers.values())} did not finish within {TIMEOUT_S} s"]
    return verdict([sent[r][1] for r in range(WORLD_SIZE)])


def _rank(rank: int, writer) -> None:
    try:
        writer.send(("ok", run_rank(rank, None), ""))
    except BaseException as exc:  # noqa: BLE001 -- the script reports every rank's error
        writer.send(("error", f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}", refusal(exc)))


def report(found: str, lines: list[str]) -> int:
    """Print the verdict and its evidence as qgather's report starts; the exit status (0: EXACT, or every
    rank refused the case alike where a refusal of it is acceptable: REFUSALS)."""
    print(f"{CASE}: {found}" + (f" - {lines[0]}" if lines else ""), *(f"  {line}" for line in lines[1:]), sep="\n")
    return 0 if found in ("EXACT", "REJECTED") else 1
