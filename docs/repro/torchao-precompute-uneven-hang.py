"""torchao: float8 FSDP2 with precomputed scales: uneven shards hang

Needs torch and torchao. Run: torchrun --nproc-per-node 2 FILE or python FILE (2 gloo ranks, CPU). Exit 1 with
qgather's verdict and evidence while the defect is there, 0 once the gathered buffers equal `quantize`'s."""
import contextlib, datetime, hashlib, multiprocessing, os, signal, socket, sys, threading, time
import multiprocessing.connection

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

CASE = 'torchao:precompute:fp8_tensor:5x64:bf16:ws2:gather:s0'
DTYPE = torch.bfloat16
WORLD_SIZE = 2
WEIGHTS = {"weight": ((5, 64), 0, 1.0)}  # name: (shape, data seed, magnitude)
TIMEOUT_S = int(os.environ.get("REPRO_TIMEOUT_S", "30"))  # every rank's deadline (a rank still waiting then: HANG)

# What the case holds: its weights, drawn as qgather draws them, and FSDP2's split of them
def make_weight(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (values * torch.exp2(torch.linspace(-6.0, 6.0, shape[0])).reshape(-1, *[1] * (len(shape) - 1))).to(dtype)
def masters(other: bool = False) -> dict[str, torch.Tensor]:
    return {name: make_weight(shape, seed + 7919 * other, torch.float32) * scale * (1 + 3 * other)
            for name, (shape, seed, scale) in WEIGHTS.items()}

# What it expects: the single-device quantization of the whole weight (qgather's quantizer, inlined)
def quantize(w: torch.Tensor, per_tensor_amax: torch.Tensor) -> dict[str, torch.Tensor]:
    amax = per_tensor_amax.float().reshape(1)
    scale = torch.where(amax == 0, 1.0, (torch.tensor([448.0]) / amax).clamp(max=torch.finfo(torch.float32).max))
    data = (w.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return {"data": data, "scale_inv": torch.tensor([1.0]) / scale}
def dequantize(q: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    return q["data"].view(torch.float8_e4m3fn).float() * q["scale_inv"]
def golden(master: torch.Tensor, rank: int) -> tuple[dict, int]:
    w, amax, row0 = master.to(DTYPE), master.to(DTYPE).abs().amax(), 0
    return quantize(w, amax), row0

# What it builds: the library's own FSDP2 route, configured as the case says
def fsdp_setup(device: torch.device, size: int):
    shape, names = (size,), None
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    kwargs = {"mesh": mesh}
    return mesh, kwargs
def float8_as_bytes_on_gloo() -> None:
    names = ("all_gather_single", "all_gather_into_tensor")  # FSDP2 calls one, by torch version
    for name, gather in [(n, getattr(dist, n)) for n in names if hasattr(dist, n)]:
        setattr(dist, name, lambda out, inp, *args, _gather=gather, **kwargs: _gather(
            *(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (out, inp)), *args, **kwargs))
def layer(master: torch.Tensor, rank: int, device: torch.device, size: int, mesh) -> torch.nn.Module:
    linear = torch.nn.Linear(master.shape[1], master.shape[0], bias=False, device=device, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.copy_(master)
    linear.weight.requires_grad_(False)
    linear = convert_to_float8_training(linear, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return linear
def read(weight: torch.Tensor, want: dict) -> dict:
    return {"data": weight._data.view(torch.uint8), "scale_inv": weight._scale.float().reciprocal().reshape(1)}
def sharded(rank: int, device: torch.device, size: int, weights: dict):
    mesh, kwargs = fsdp_setup(device, size)
    layers = {name: layer(master, rank, device, size, mesh) for name, master in weights.items()}
    root = layers["weight"]
    fully_shard(root, **kwargs)
    return root, layers

# What it checks: every unshard's buffers against the golden, bit for bit
def gathered(rank: int, device: torch.device) -> list[tuple]:
    full = masters()
    root, layers = sharded(rank, device, WORLD_SIZE, full)
    return judge(root, layers, full, rank, "unshard 1")
def judge(root, layers: dict, full: dict, rank: int, label: str) -> list[tuple]:
    # torchao: the scales for the all-gather, as a training loop computes them after each step
    precompute_float8_dynamic_scale_for_fsdp(root)
    root.unshard()
    stages = []
    for name, each in layers.items():
        want, row0 = golden(full[name].detach(), rank)
        weight = getattr(each.weight, "_local_tensor", each.weight)  # a DTensor on "tp": this rank's piece
        got = {key: value.detach().cpu().clone() for key, value in read(weight, want).items()}  # reshard frees them
        where = label if len(layers) == 1 else f"{label}: weight {name} {'x'.join(map(str, full[name].shape))}"
        digest = hashlib.sha256(b"".join(got[n].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(got)))
        stages.append((where, compare(got, want, tuple(weight.shape), row0), digest.hexdigest()))
    root.reshard()
    return stages
def compare(got: dict, want: dict, shape: tuple[int, ...], row0: int) -> list[str]:
    lines = [f"{name}: shape {tuple(got[name].shape)}, expected {tuple(w.shape)}" for name, w in want.items()
             if got[name].shape != w.shape]
    for name, expected in [(name, w) for name, w in want.items() if got[name].shape == w.shape]:
        differ = (got[name].view(torch.uint8) != expected.view(torch.uint8)).view(*expected.shape, -1).any(-1)
        if differ.any():
            lines.append(f"{name}: {int(differ.sum())} of {differ.numel()} valid elements differ")
    got_values, want_values = dequantize(got, shape), dequantize(want, shape)
    if lines and got_values.shape == want_values.shape and bool((got_values != want_values).any()):
        differ = (got_values != want_values).reshape(-1, shape[-1])
        rows = (differ.any(1).nonzero().flatten() + row0).tolist()
        lines.append(f"dequantized weight: {int(differ.sum())} elements differ, max |diff| "
                     f"{float((got_values - want_values).abs().max()):.3g}; rows {rows[0]}-{rows[-1]}")
    return lines

# Running the ranks under one deadline; the verdict as qgather reports it
def main() -> int:
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
        print(f"{CASE}: ERROR - rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        raise  # torchrun stops the other ranks
    dist.all_gather_object(every := [None] * WORLD_SIZE, stages)
    status = report(*verdict(every)) if rank == 0 else int(verdict(every)[0] != "EXACT")
    dist.barrier()  # rank 0 has printed before any rank exits: torchrun stops the others at the first exit 1
    dist.destroy_process_group()
    return status
def run_rank(rank: int, device, backend: str = "gloo") -> list[dict]:
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if backend == "gloo":  # the library all-gathers float8 tensors, which gloo cannot
        float8_as_bytes_on_gloo()
    return [{"rank": rank, "label": label, "lines": lines, "digest": digest}
            for label, lines, digest in gathered(rank, device or torch.device("cpu"))]
def refusal(exc: BaseException) -> str:
    return ""  # no error is a refusal of this case
def verdict(every: list[list[dict]]) -> tuple[str, list[str]]:
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
    if failed or readers:
        return ("CRASH" if died else "ERROR" if failed else "HANG"), failed or [
            f"ranks {sorted(readers.values())} did not finish within {TIMEOUT_S} s"]
    return verdict([sent[r][1] for r in range(WORLD_SIZE)])
def _rank(rank: int, writer) -> None:
    try:
        writer.send(("ok", run_rank(rank, None), ""))
    except BaseException as exc:  # the script reports every rank's error
        writer.send(("error", f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}", refusal(exc)))
def report(found: str, lines: list[str]) -> int:
    print(f"{CASE}: {found}" + (f" - {lines[0]}" if lines else ""), *(f"  {line}" for line in lines[1:]), sep="\n")
    return 0 if found in ("EXACT", "REJECTED") else 1

if __name__ == "__main__":
    sys.exit(main())
