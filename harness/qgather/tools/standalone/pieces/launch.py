"""Running the ranks: under torchrun (NCCL on GPUs; gloo on CUDA with more ranks than GPUs), or
`python FILE`, which forks WORLD_SIZE gloo ranks on the CPU (`spawn`; a GPU library's script says to
use torchrun instead, `torchrun_only`) and waits for all of them under one deadline, so that a rank
that raises, dies or hangs is reported as qgather reports it (ERROR, CRASH, HANG) instead of waited on."""

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
    if "RANK" not in os.environ:  # python FILE
        return report(*spawn())
    rank, gpus = int(os.environ["RANK"]), torch.cuda.device_count()
    if int(os.environ["WORLD_SIZE"]) != WORLD_SIZE:
        sys.exit(f"this case runs at {WORLD_SIZE} ranks: torchrun --nproc-per-node {WORLD_SIZE} {sys.argv[0]}")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % gpus) if gpus else None
    deadline = threading.Timer(TIMEOUT_S, lambda: (print(f"{CASE}: HANG - rank {rank}: no result within "
                                                          f"{TIMEOUT_S} s (REPRO_TIMEOUT_S)", flush=True), os._exit(1)))
    deadline.daemon = True  # our own deadline: NCCL's watchdog does not always end a rank stuck in a collective
    deadline.start()
    try:
        stages = run_rank(rank, device, "nccl" if gpus >= WORLD_SIZE else "gloo")
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        print(f"{CASE}: ERROR - rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        raise  # torchrun stops the other ranks
    every = [None] * WORLD_SIZE
    dist.all_gather_object(every, stages)
    status = report(*verdict(every)) if rank == 0 else int(verdict(every)[0] != "EXACT")
    dist.barrier()  # rank 0 has printed before any rank exits: torchrun stops the others at the first exit 1
    dist.destroy_process_group()
    return status


def run_rank(rank: int, device, backend: str = "gloo") -> list[dict]:
    """One rank: join the group, run the scenario, each stage's evidence against the golden."""
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if FLOAT8_WIRE:  # the library all-gathers float8 tensors, which gloo cannot
        if backend == "gloo":
            float8_as_bytes_on_gloo()
    return [{"rank": rank, "label": label, "lines": lines, "digest": digest}
            for label, lines, digest in gathered(rank, device or torch.device("cpu"))]


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
    sent, deadline = {}, time.monotonic() + TIMEOUT_S
    while readers and time.monotonic() < deadline:
        for reader in multiprocessing.connection.wait(list(readers), deadline - time.monotonic()):
            rank = readers.pop(reader)
            with contextlib.suppress(EOFError):  # EOF: it died before it could say anything
                sent[rank] = reader.recv()
            sent.setdefault(rank, ("died", ""))
            if sent[rank][0] != "ok":  # the others may wait for it in a collective: a short grace
                deadline = min(deadline, time.monotonic() + 5.0)
    for process in ranks:  # a rank still waiting is killed
        process.join(0 if readers else 1.0), process.kill(), process.join()
    died = [f"rank {r} killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"rank {r} exited with "
            f"status {p.exitcode}" for r, p in enumerate(ranks) if sent.get(r, ("",))[0] == "died"]  # the root cause
    failed = died + [f"rank {r}: {value}" for r, (kind, value) in sent.items() if kind == "error"]  # first
    refused = len(failed) == WORLD_SIZE and not died and len({value for _, value in sent.values()}) == 1 and not (
        re.match(r"(Attribute|Name|Type|Key|Index|Import|ModuleNotFound|UnboundLocal)Error:", failed[0]))  # a refusal
    if failed or readers:
        return ("CRASH" if died else "REJECTED" if refused else "ERROR" if failed else "HANG"), failed or [
            f"ranks {sorted(readers.values())} did not finish within {TIMEOUT_S} s"]
    return verdict([sent[r][1] for r in range(WORLD_SIZE)])


def _rank(rank: int, writer) -> None:
    try:
        writer.send(("ok", run_rank(rank, None)))
    except BaseException as exc:  # noqa: BLE001 -- the script reports every rank's error
        writer.send(("error", f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"))


def torchrun_only() -> tuple[str, list[str]]:
    """`python FILE` of a GPU library's script: it runs under torchrun."""
    return "SKIPPED", [f"the library runs on GPUs, one rank each: torchrun --nproc-per-node {WORLD_SIZE} {sys.argv[0]}"]


def report(found: str, lines: list[str]) -> int:
    """Print the verdict and its evidence as qgather's report starts; the exit status (0: EXACT, or every
    rank refused the case with one error; 2: not run)."""
    print(f"{CASE}: {found}" + (f" - {lines[0]}" if lines else ""), *(f"  {line}" for line in lines[1:]), sep="\n")
    return {"EXACT": 0, "REJECTED": 0, "SKIPPED": 2}.get(found, 1)  # REJECTED: every rank refused alike
