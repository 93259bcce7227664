"""torchao: float8 FSDP2 all-gather: a rank with zero rows raises, the others wait

Expected: A 5-row weight on 4 ranks (2, 2, 1 and 0 rows) gathers to the single-device cast: an empty shard
contributes amax 0 to the all-reduce.

qgather case torchao:fp8_tensor:5x64:bf16:ws4:gather:s0 without qgather: torch, torchao and the standard
library. Run: torchrun --nproc-per-node 4 FILE or python FILE (4 gloo ranks on the CPU). It prints the verdict
and the evidence of qgather's report: exit 1 while the defect is there, 0 once every gathered buffer equals
the single-device quantization (qgather's reference quantizer, inlined) bit for bit.
"""
import contextlib, datetime, hashlib, itertools, multiprocessing, os, signal, socket, sys, threading, time
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

CASE = 'torchao:fp8_tensor:5x64:bf16:ws4:gather:s0'
SHAPE = (5, 64)  # the weight (out_features, in_features)
SEED = 0  # the weight is drawn from it exactly as qgather draws it
DTYPE = torch.bfloat16
WORLD_SIZE = 4
TIMEOUT_S = int(os.environ.get("REPRO_TIMEOUT_S", "120"))  # every rank's deadline (a rank still waiting then: HANG)

def make_weight(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (values * torch.exp2(torch.linspace(-6.0, 6.0, shape[0])).reshape(-1, *[1] * (len(shape) - 1))).to(dtype)

def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    amax = w.abs().amax().float().reshape(1)
    scale = torch.tensor([448.0]) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    data = (w.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return {"data": data, "scale_inv": torch.tensor([1.0]) / scale}

def dequantize(q: dict[str, torch.Tensor]) -> torch.Tensor:
    return q["data"].view(torch.float8_e4m3fn).float() * q["scale_inv"]

def gathered(rank: int, device: torch.device) -> list[tuple]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    weight = make_weight(SHAPE, SEED, DTYPE)
    linear = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False, device=device, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.copy_(weight)
    linear.weight.requires_grad_(False)
    linear = convert_to_float8_training(linear, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    want, label, row0 = quantize(weight), "unshard 1", 0
    fully_shard(linear, mesh=init_device_mesh(device.type, (WORLD_SIZE,)))
    with float8_as_bytes_on_gloo():
        linear.unshard()
    w = linear.weight
    got = {"data": w._data.view(torch.uint8), "scale_inv": w._scale.float().reciprocal().reshape(1)}
    return [(label, row0, got, want)]

@contextlib.contextmanager
def float8_as_bytes_on_gloo():
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]  # by torch version
    saved = {name: getattr(dist, name) for name in names if dist.get_backend() == "gloo"}

    def as_bytes(original):
        return lambda out, inp, *args, **kwargs: original(
            *(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (out, inp)), *args, **kwargs)

    for name, original in saved.items():
        setattr(dist, name, as_bytes(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)

def compare(got: dict, want: dict, got_values: torch.Tensor, want_values: torch.Tensor, row0: int) -> list[str]:
    lines = []
    for name, expected in want.items():
        actual = got[name].detach().cpu()
        if actual.shape != expected.shape:
            lines.append(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            continue
        differ = (actual.view(torch.uint8) != expected.view(torch.uint8)).view(*expected.shape, -1).any(-1)  # elements
        if differ.any():
            lines.append(f"{name}: {int(differ.sum())} of {differ.numel()} valid elements differ")
    if lines and got_values.shape == want_values.shape and want_values.numel():
        differ = got_values.cpu() != want_values
        rows = (differ.any(1).nonzero().flatten() + row0).tolist()
        lines.append(f"dequantized weight: {int(differ.sum())} elements differ, max |diff| "
                     f"{float((got_values.cpu() - want_values).abs().max()):.3g}; rows {row_ranges(rows)}")
    return lines

def row_ranges(rows: list[int]) -> str:
    runs = [[row for _, row in run] for _, run in itertools.groupby(enumerate(rows), key=lambda p: p[1] - p[0])]
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs) or "none"

def main() -> int:
    if "RANK" not in os.environ:  # python FILE
        return report(*spawn())
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != WORLD_SIZE:
        sys.exit(f"this case runs at {WORLD_SIZE} ranks: torchrun --nproc-per-node {WORLD_SIZE} {sys.argv[0]}")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else None
    deadline = threading.Timer(TIMEOUT_S, lambda: (print(f"{CASE}: HANG - rank {rank}: no result within "
                                                          f"{TIMEOUT_S} s (REPRO_TIMEOUT_S)", flush=True), os._exit(1)))
    deadline.daemon = True  # our own deadline: NCCL's watchdog does not always end a rank stuck in a collective
    deadline.start()
    try:
        stages = run_rank(rank, device)
    except Exception as exc:
        print(f"{CASE}: ERROR - rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        raise  # torchrun stops the other ranks
    every = [None] * WORLD_SIZE
    dist.all_gather_object(every, stages)
    status = report(*verdict(every)) if rank == 0 else int(verdict(every)[0] != "EXACT")
    dist.barrier()  # rank 0 has printed before any rank exits: torchrun stops the others at the first exit 1
    deadline.cancel()  # the verdict is out: no HANG after it
    dist.destroy_process_group()
    return status

def run_rank(rank: int, device) -> list[dict]:
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device is not None else "gloo", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))  # NCCL's watchdog then aborts the rank
    return [{"rank": rank, "label": label, "lines": compare(got, want, dequantize(got), dequantize(want), row0),
             "digest": hashlib.sha256(b"".join(got[n].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                                               for n in sorted(got))).hexdigest()}
            for label, row0, got, want in gathered(rank, device or torch.device("cpu"))]

def verdict(every: list[list[dict]]) -> tuple[str, list[str]]:
    for stage in zip(*every):
        digests, found = {}, {}
        for r in stage:
            digests.setdefault(r["label"], set()).add(r["digest"])  # ranks that gathered one piece agree on it
            if r["lines"]:
                found.setdefault((r["label"], *r["lines"]), []).append(r["rank"])
        shown = [f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {label}: {'; '.join(lines)}"
                 for (label, *lines), ranks in found.items()]
        if any(len(d) > 1 for d in digests.values()):
            return "RANK_DIVERGENCE", shown or ["ranks gathered different bytes"]
        if shown:
            return "SILENT_MISMATCH", shown
    return "EXACT", []

def spawn() -> tuple[str, list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    fork, ranks, readers = multiprocessing.get_context("fork"), [], {}  # fork: under exec(open(FILE).read()) too
    for rank in range(WORLD_SIZE):
        reader, writer = fork.Pipe(duplex=False)
        ranks.append(fork.Process(target=_rank, args=(rank, writer), daemon=True))
        ranks[-1].start()
        writer.close()  # the reader sees EOF when the rank dies
        readers[reader] = rank
    sent, deadline = {}, time.monotonic() + TIMEOUT_S
    while readers and time.monotonic() < deadline:
        for reader in wait(list(readers), deadline - time.monotonic()):
            rank = readers.pop(reader)
            with contextlib.suppress(EOFError):  # EOF: it died before it could say anything
                sent[rank] = reader.recv()
            if sent.get(rank, ("",))[0] != "ok":  # the others may wait for it in a collective: a short grace
                deadline = min(deadline, time.monotonic() + 5.0)
    for process in ranks:
        process.join(timeout=0 if readers else 1.0)
        process.kill()  # a rank still waiting
        process.join()
    died = [f"rank {r} " + (f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else
                            f"exited with status {p.exitcode}") for r, p in enumerate(ranks) if r not in sent
            and r not in readers.values()]
    errors = [f"rank {r}: {value}" for r, (kind, value) in sent.items() if kind == "error"]  # the root cause first
    if died or errors:
        return "CRASH" if died else "ERROR", died + errors
    if readers:
        return "HANG", [f"ranks {sorted(readers.values())} did not finish within {TIMEOUT_S} s"]
    return verdict([sent[r][1] for r in range(WORLD_SIZE)])

def _rank(rank: int, writer) -> None:
    try:
        writer.send(("ok", run_rank(rank, None)))
    except Exception as exc:  # the script reports every rank's error
        writer.send(("error", f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"))

def report(found: str, lines: list[str]) -> int:
    print(f"{CASE}: {found}" + (f" - {lines[0]}" if lines else ""), *(f"  {line}" for line in lines[1:]), sep="\n")
    return {"EXACT": 0, "SKIPPED": 2}.get(found, 1)

if __name__ == "__main__":
    sys.exit(main())
