"""TransformerEngine: Float8Tensor under FSDP2: uneven shards raise on the padded ranks only

Expected: A 31-row weight on 2 ranks (16 + 15 rows) gathers to the single-GPU Float8CurrentScaling
quantization, or every rank refuses it before the collective.

qgather case te:fp8_tensor:31x128:bf16:ws2:gather:s0 without qgather: torch, transformer_engine and the
standard library. Run: torchrun --nproc-per-node 2 FILE. It prints the verdict and the evidence of qgather's
report: exit 1 while the defect is there, 0 once every gathered buffer equals the single-device quantization
(qgather's reference quantizer, inlined) bit for bit.
"""
import datetime, hashlib, itertools, os, sys, threading

import torch
import torch.distributed as dist

CASE = 'te:fp8_tensor:31x128:bf16:ws2:gather:s0'
SHAPE = (31, 128)  # the weight (out_features, in_features)
SEED = 0  # the weight is drawn from it exactly as qgather draws it
DTYPE = torch.bfloat16
WORLD_SIZE = 2
RECIPE = 'Float8CurrentScaling'  # transformer_engine.common.recipe
TIMEOUT_S = int(os.environ.get("REPRO_TIMEOUT_S", "120"))  # every rank's deadline (a rank still waiting then: HANG)

def make_weight(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (values * torch.exp2(torch.linspace(-6.0, 6.0, shape[0])).reshape(-1, *[1] * (len(shape) - 1))).to(dtype)

def shard_rows(rows: int, world_size: int, rank: int) -> slice:
    chunk = -(-rows // world_size)
    return slice(min(rank * chunk, rows), min((rank + 1) * chunk, rows))

def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    amax = w.abs().amax().float().reshape(1)
    scale = torch.tensor([448.0]) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    data = (w.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return {"data": data, "scale_inv": torch.tensor([1.0]) / scale}

def dequantize(q: dict[str, torch.Tensor]) -> torch.Tensor:
    return q["data"].view(torch.float8_e4m3fn).float() * q["scale_inv"]

def sharded(rank: int, device: torch.device):
    import transformer_engine.pytorch as te
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformer_engine.common import recipe

    weight = make_weight(SHAPE, SEED, torch.float32)
    mine = weight.to(DTYPE)[shard_rows(SHAPE[0], WORLD_SIZE, rank)].to(device)

    def init_method(local: torch.Tensor) -> None:
        with torch.no_grad():
            local.copy_(mine)

    with te.quantized_model_init(enabled=True, recipe=getattr(recipe, RECIPE)()):
        linear = te.Linear(SHAPE[1], SHAPE[0], bias=False, params_dtype=DTYPE, device="meta", init_method=init_method)
    fully_shard(linear, mesh=init_device_mesh(device.type, (WORLD_SIZE,)))
    with torch.enable_grad():
        linear.reset_parameters()
    return linear, weight

def read(linear, want: dict) -> dict:
    w = linear.weight
    return {"data": w._data.view(torch.uint8), "scale_inv": w._scale_inv.float().reshape(1)}

def gathered(rank: int, device: torch.device) -> list[tuple]:
    module, weight = sharded(rank, device)
    want = quantize(weight.to(DTYPE))
    module.unshard()
    return [("unshard 1", 0, read(module, want), want)]

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
    return "SKIPPED", [f"the library runs on GPUs, one rank each: torchrun --nproc-per-node {WORLD_SIZE} {sys.argv[0]}"]

def report(found: str, lines: list[str]) -> int:
    print(f"{CASE}: {found}" + (f" - {lines[0]}" if lines else ""), *(f"  {line}" for line in lines[1:]), sep="\n")
    return {"EXACT": 0, "SKIPPED": 2}.get(found, 1)

if __name__ == "__main__":
    sys.exit(main())
