"""The scenario a script runs over a route's `layer`, `read`, `requantize` and `forward`
(pieces.routes, pieces.reference), as qgather.scenarios runs it: the case's module (one weight; a
layer per weight, each its own fully_shard group, under `layers`; every weight in one group under
`block`) sharded as the case's configuration says (pieces.fsdp), then `gathered_once` (FSDP2's first
unshard; under dcp-wsA after the checkpoint's load; under compile the compiled forward against the
eager one) or `gathered_steps` (steps and reshard: optimizer steps, each shard re-quantized, each
re-gather judged). Each returns this rank's (label, evidence lines, digest of what it gathered) per stage."""

# ruff: noqa: F821 -- the script defines CASE, WEIGHTS, ... and the other pieces' functions (see __init__)

from __future__ import annotations

import hashlib
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard


class Layers(torch.nn.ModuleDict):
    """The module of a layers or block case: its layers' outputs side by side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x).flatten() for layer in self.values()])


def sharded(rank: int, device: torch.device, size: int, weights: dict):
    """The module holding `weights` (name -> float32 master), sharded over ranks 0..size-1: the root
    and its layers by name (None and {} on a rank outside them)."""
    mesh, kwargs = fsdp_setup(device, size)
    if SAVED_AT:
        if mesh is None:  # a rank of the other phase's world only
            return None, {}
    layers = {name: layer(master, rank, device, size, mesh) for name, master in weights.items()}
    if LAYERS:  # a fully_shard group per layer, then the root's
        for each in layers.values():
            fully_shard(each, **kwargs)
    if LAYERS or BLOCK:
        root = Layers(layers)
    else:
        root = layers["weight"]
    if BLOCK:  # high-precision parameters between the weights, all in the block's one group
        root.norm = torch.nn.Parameter(make_weight((SHAPE[-1],), SEED + 5000, DTYPE).to(device))
    fully_shard(root, **kwargs)
    if NESTED:  # the block inside a model root with a parameter of its own
        root, block = torch.nn.Module(), root
        root.block = block
        root.scale = torch.nn.Parameter(make_weight((SHAPE[-1],), SEED + 5002, DTYPE).to(device))
        fully_shard(root, **kwargs)
    if RESET:  # TE: materialize and quantize each rank's shard
        with torch.enable_grad():
            for each in layers.values():
                each.reset_parameters()
    return root, layers


def golden(master: torch.Tensor, rank: int) -> tuple[dict, int]:
    """This rank's golden: the single-device quantization of the whole weight (under TP: of its TP
    piece, with the whole weight's amax) and the first global row of what it gathers."""
    w, amax, row0 = master.to(DTYPE), master.to(DTYPE).abs().amax(), 0
    if DELAYED:  # DelayedScaling's scale is its initial 1 until a forward updates it: amax = 448
        amax = torch.tensor(448.0)
    if TP:
        w, row0 = tp_piece(w, rank), (shard_rows(SHAPE[0], TP, rank % TP).start if TP_DIM == 0 else 0)
    return quantize(w, amax), row0


def judge(root, layers: dict, full: dict, rank: int, label: str) -> list[tuple]:
    """Unshard (every group), compare each gathered weight with its golden, reshard."""
    if PRECOMPUTE:  # torchao: the scales for the all-gather, as a training loop computes them after each step
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(root)
    root.unshard()
    if LAYERS:  # a group per layer
        for each in layers.values():
            each.unshard()
    if NESTED:  # the block's group: the model root's unshard does not reach it
        root.block.unshard()
    stages = []
    for name, each in layers.items():
        want, row0 = golden(full[name].detach(), rank)
        weight = getattr(each.weight, "_local_tensor", each.weight)  # a DTensor on "tp": this rank's piece
        got = {key: value.detach().cpu().clone() for key, value in read(weight, want).items()}  # reshard frees them
        where = label if len(layers) == 1 else f"{label}: weight {name} {'x'.join(map(str, full[name].shape))}"
        if TP:
            where += f": tp rank {rank % TP} of {TP}"
        digest = hashlib.sha256(b"".join(got[n].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(got)))
        stages.append((where, compare(got, want, tuple(weight.shape), row0), digest.hexdigest()))
        if MP:  # FSDP2 hands the post-all-gather hook the policy's param_dtype: qgather checks it first
            if weight.dtype != MP:
                wrong = f"the unsharded weight is {weight.dtype}, the mixed-precision policy asks for {MP}"
                stages[-1] = (where, [wrong], digest.hexdigest())
    root.reshard()
    if LAYERS:
        for each in layers.values():
            each.reshard()
    if NESTED:
        root.block.reshard()
    return stages


def make_input() -> torch.Tensor:
    """The layer input: 8 rows of the weight's K (qgather.scenarios.data.make_input)."""
    return torch.randn((8, SHAPE[-1]), generator=torch.Generator().manual_seed(SEED + 7)).to(DTYPE)


def gathered(rank: int, device: torch.device) -> list[tuple]:
    """The module sharded, then its first unshard judged (compile: then the compiled forward's)."""
    full = masters()
    root, layers = sharded(rank, device, WORLD_SIZE, full)
    if COMPILE:
        return judge(root, layers, full, rank, "unshard 1") + compiled(root, rank)
    return judge(root, layers, full, rank, "unshard 1")


def gathered_again(rank: int, device: torch.device) -> list[tuple]:
    """The module sharded, then its unshards judged (`unshards`: steps)."""
    full = masters()
    root, layers = sharded(rank, device, WORLD_SIZE, full)
    return unshards(root, layers, full, rank, device, WORLD_SIZE)


def gathered_checkpoint(rank: int, device: torch.device) -> list[tuple]:
    """dcp-wsA: the checkpoint saved at SAVED_AT ranks, loaded into a module built from other values at
    LOADED_AT ranks, then its unshards judged (`unshards`)."""
    full, (path, group) = masters(), saved_checkpoint(rank, device)
    root, layers = sharded(rank, device, LOADED_AT, masters(other=True))  # a decoy: the load must overwrite it
    stages = []
    if root is not None:  # not a rank of the saving world only
        state = root.state_dict()  # as training code resumes: dcp.load in place, then load_state_dict
        dcp.load(state, checkpoint_id=path, process_group=group)
        root.load_state_dict(state)
        if STEPS or COMPILE:
            stages = unshards(root, layers, full, rank, device, LOADED_AT)
        else:
            stages = judge(root, layers, full, rank, "unshard 1")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return stages


def gathered_once(root, layers: dict, full: dict, rank: int, device: torch.device, size: int) -> list[tuple]:
    """FSDP2's first unshard (compile: then the compiled forward's, against the eager one's)."""
    stages = judge(root, layers, full, rank, "unshard 1")
    if COMPILE:
        stages += compiled(root, rank)
    return stages


def gathered_steps(root, layers: dict, full: dict, rank: int, device: torch.device, size: int) -> list[tuple]:
    """unshard 1 (REQUANTIZE_FIRST: after each shard was re-quantized from its own, unchanged rows, an
    optimizer step before the first all-gather), then STEPS SGD steps on this rank's rows and, for the
    golden, on the whole weight, each shard re-quantized from its new rows and re-gathered (compile:
    after each, the compiled forward against the eager one)."""
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
            if REFUSALS:  # an optimizer step's write: a refusal after it is no REJECTED (qgather's phases)
                DATA_MOVED.set()
            with torch.no_grad():
                for name, each in layers.items():
                    requantize(each, mine[name].detach().to(device, DTYPE))
        stages += judge(root, layers, full, rank, f"unshard {step + 1}" + (f" (after step {step})" if step else ""))
        if COMPILE:
            stages += compiled(root, rank)
    return stages


def compiled(root, rank: int) -> list[tuple]:
    """The module's forward compiled (aot_eager: Dynamo flattens the gathered subclass to its inner
    tensors and rebuilds it) against its eager forward, bit for bit; FSDP2's pre-forward unshard
    gathers the weight for each."""
    x = make_input().to(next(root.parameters()).device)
    with torch.no_grad():
        eager = forward(root, x).float().cpu()
        out = forward(torch.compile(root, backend="aot_eager"), x).float().cpu()
    differ = (eager != out) & ~(eager.isnan() & out.isnan())
    lines = [f"compiled output: {int(differ.sum())} of {differ.numel()} elements differ from the eager forward's, "
             f"max |diff| {float((eager - out).abs().max()):.3g}"] if differ.any() else []
    return [("compiled forward (aot_eager)", lines, hashlib.sha256(out.numpy().tobytes()).hexdigest())]
