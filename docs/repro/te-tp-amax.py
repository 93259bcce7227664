"""TransformerEngine: te.Linear with tp_group under FSDP2: each TP piece quantized with the amax of its dp shards only

Needs torch and transformer_engine. Run: torchrun --nproc-per-node 2 FILE. Exit 1 with qgather's verdict and
evidence while the defect is there, 0 once the gathered buffers equal `quantize`'s."""
import datetime, hashlib, os, sys, threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from transformer_engine.common import recipe
import transformer_engine.pytorch as te

CASE = 'te:fp8_tensor:128x64:fp32:ws2:reshard:s0:tp-1x2'
SHAPE = (128, 64)  # the weight (out_features, in_features)
DTYPE = torch.float32
WORLD_SIZE = 2
WEIGHTS = {"weight": ((128, 64), 0, 1.0)}  # name: (shape, data seed, magnitude)
TP = 2  # tensor-parallel size: a ("dp", "tp") mesh of (ranks // TP, TP)
TP_DIM = 0  # 0: ColwiseParallel (rows), 1: RowwiseParallel (columns)
STEPS = 1  # SGD steps (lr 0.05, momentum 0.9), each followed by a re-gather
REQUANTIZE_FIRST = False  # re-quantize every shard from its unchanged rows before the first all-gather
TIMEOUT_S = int(os.environ.get("REPRO_TIMEOUT_S", "30"))  # every rank's deadline (a rank still waiting then: HANG)
RECIPE = 'Float8CurrentScaling'  # transformer_engine.common.recipe

# What the case holds: its weights, drawn as qgather draws them, and FSDP2's split of them
def make_weight(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (values * torch.exp2(torch.linspace(-6.0, 6.0, shape[0])).reshape(-1, *[1] * (len(shape) - 1))).to(dtype)
def shard_rows(rows: int, world_size: int, rank: int) -> slice:
    chunk = -(-rows // world_size)
    return slice(min(rank * chunk, rows), min((rank + 1) * chunk, rows))
def tp_piece(full: torch.Tensor, rank: int) -> torch.Tensor:
    cut = shard_rows(full.shape[TP_DIM], TP, rank % TP)
    return full[cut] if TP_DIM == 0 else full[:, cut]
def local_part(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    full, size, rank = tp_piece(full, rank), size // TP, rank // TP  # FSDP2 shards this rank's TP piece over "dp"
    return full[shard_rows(full.shape[0], size, rank)]
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
    w, row0 = tp_piece(w, rank), (shard_rows(SHAPE[0], TP, rank % TP).start if TP_DIM == 0 else 0)
    return quantize(w, amax), row0

# What it builds: the library's own FSDP2 route, configured as the case says
def fsdp_setup(device: torch.device, size: int):
    shape, names = (size // TP, TP), ("dp", "tp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    kwargs = {"mesh": mesh and mesh["dp"]}  # FSDP2 shards each TP piece over "dp"
    return mesh, kwargs
def layer(master: torch.Tensor, rank: int, device: torch.device, size: int, mesh) -> torch.nn.Module:
    mine = local_part(master.to(DTYPE), rank, size).to(device)
    def init_method(local: torch.Tensor) -> None:  # what TE calls on this rank's materialized shard
        with torch.no_grad():
            local.copy_(mine)
    with te.quantized_model_init(enabled=True, recipe=getattr(recipe, RECIPE)()):
        # TE's own tensor parallelism: the module holds its piece
        return te.Linear(master.shape[1], master.shape[0], bias=False, params_dtype=DTYPE, device="meta",
                         init_method=init_method, tp_group=mesh["tp"].get_group(), tp_size=TP,
                         parallel_mode="row" if TP_DIM else "column")
        return te.Linear(master.shape[1], master.shape[0], bias=False, params_dtype=DTYPE, device="meta",
                         init_method=init_method)
def read(weight: torch.Tensor, want: dict) -> dict:
    weight.dequantize()
    return {"data": weight._data.view(torch.uint8), "scale_inv": weight._scale_inv.float().reshape(1)}
def requantize(layer: torch.nn.Module, rows: torch.Tensor) -> None:
    layer.weight.to_local().quantize_(rows)
def sharded(rank: int, device: torch.device, size: int, weights: dict):
    mesh, kwargs = fsdp_setup(device, size)
    layers = {name: layer(master, rank, device, size, mesh) for name, master in weights.items()}
    root = layers["weight"]
    fully_shard(root, **kwargs)
    with torch.enable_grad():  # TE: materialize and quantize each rank's shard
        for each in layers.values():
            each.reset_parameters()
    return root, layers

# What it checks: every unshard's buffers against the golden, bit for bit
def gathered(rank: int, device: torch.device) -> list[tuple]:
    full = masters()
    root, layers = sharded(rank, device, WORLD_SIZE, full)
    return unshards(root, layers, full, rank, device, WORLD_SIZE)
def unshards(root, layers: dict, full: dict, rank: int, device: torch.device, size: int) -> list[tuple]:
    full = {name: torch.nn.Parameter(w.clone()) for name, w in full.items()}
    mine = {name: torch.nn.Parameter(local_part(w.detach(), rank, size).clone()) for name, w in full.items()}
    optimizer, stages = torch.optim.SGD([*mine.values(), *full.values()], lr=0.05, momentum=0.9), []  # per tensor
    for step in range(STEPS + 1):
        if step:
            for name, (shape, seed, _) in WEIGHTS.items():
                grad = make_weight(shape, seed * 1000 + step, torch.float32)
                mine[name].grad, full[name].grad = local_part(grad, rank, size).clone(), grad
            optimizer.step()
        if step or REQUANTIZE_FIRST:
            with torch.no_grad():
                for name, each in layers.items():
                    requantize(each, mine[name].detach().to(device, DTYPE))
        stages += judge(root, layers, full, rank, f"unshard {step + 1}" + (f" (after step {step})" if step else ""))
    return stages
def judge(root, layers: dict, full: dict, rank: int, label: str) -> list[tuple]:
    root.unshard()
    stages = []
    for name, each in layers.items():
        want, row0 = golden(full[name].detach(), rank)
        weight = getattr(each.weight, "_local_tensor", each.weight)  # a DTensor on "tp": this rank's piece
        got = {key: value.detach().cpu().clone() for key, value in read(weight, want).items()}  # reshard frees them
        where = label if len(layers) == 1 else f"{label}: weight {name} {'x'.join(map(str, full[name].shape))}"
        where += f": tp rank {rank % TP} of {TP}"
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
    return [{"rank": rank, "label": label, "lines": lines, "digest": digest}
            for label, lines, digest in gathered(rank, device or torch.device("cpu"))]
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
def report(found: str, lines: list[str]) -> int:
    print(f"{CASE}: {found}" + (f" - {lines[0]}" if lines else ""), *(f"  {line}" for line in lines[1:]), sep="\n")
    return 0 if found in ("EXACT", "REJECTED") else 1

if __name__ == "__main__":
    sys.exit(main())
