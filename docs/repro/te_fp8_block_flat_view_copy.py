"""TransformerEngine: Float8BlockwiseQTensor under FSDP2 keeps a dequantized bf16 copy of every shard

TransformerEngine 2.20.2, torch 2.11.
At the first unshard, FSDP2's lazy initialization (FSDPParam.reset_sharded_param) flattens each local
shard with `local_tensor.view(-1)`. TE's view of a 2-D-scaled Float8BlockwiseQTensor to another shape
returns its dequantized values instead, so FSDP2 keeps a plain bf16 copy of every shard for the life of
the module (2 bytes per element beside the FP8 shard's 2: rowwise and columnwise), and the dequantization
allocates two float32 copies of the shard while it runs. Float8CurrentScaling's Float8Tensor is the
control: its flat view is a view.

TE's own route (modules on meta under quantized_model_init, fully_shard, reset_parameters), one
te.Linear of WEIGHT: its first unshard, then a forward and backward under te.autocast. Prints, for
each recipe, the FP8 shard's bytes, the first unshard's peak (the lazy initialization and the
all-gather) and what stays allocated after the step (grads freed). Exit 1 while the blockwise shard
is kept twice, 0 once it is not.

    PYTHONPATH=/opt/te/site torchrun --nproc-per-node 2 FILE [M K]
"""

import gc
import os
import sys
import threading
import warnings

import torch
import torch.distributed as dist
import transformer_engine
import transformer_engine.pytorch as te
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformer_engine.common import recipe

WEIGHT = (8192, 28672)  # (out_features, in_features) of the layer
MiB = 2**20
TIMEOUT_S = int(os.environ.get("REPRO_TIMEOUT_S", "30"))  # the deadline (HANG after it)
BUFFERS = ("_rowwise_data", "_columnwise_data", "_rowwise_scale_inv", "_columnwise_scale_inv", "_data", "_transpose",
           "_scale_inv")
autocast = getattr(te, "autocast", None) or te.fp8_autocast


def buffer_bytes(t: torch.Tensor) -> int:
    buffers = (getattr(t, name, None) for name in BUFFERS)
    return sum(b.numel() * b.element_size() for b in buffers if isinstance(b, torch.Tensor))


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def train_step(layer: torch.nn.Module, rec, k: int) -> None:
    """One forward and backward, the gradients then freed."""
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with autocast(enabled=True, recipe=rec):
        y = layer(x)
    y.float().sum().backward()
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)


def measure(name: str, rec, mesh, m: int, k: int) -> dict:
    gc.collect()  # an earlier layer, held by FSDP2's reference cycles
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with te.quantized_model_init(enabled=True, recipe=rec):
        layer = te.Linear(k, m, bias=False, params_dtype=torch.bfloat16, device="meta")
    fully_shard(layer, mesh=mesh)
    layer.reset_parameters()
    torch.cuda.synchronize()
    built = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer.unshard()  # the first: FSDP2's lazy initialization, then the all-gather
    torch.cuda.synchronize()
    unshard_peak = torch.cuda.max_memory_allocated() - built
    layer.reshard()
    train_step(layer, rec, k)
    kept = torch.cuda.memory_allocated() - built
    local = layer.weight._local_tensor
    flat = None
    try:  # what FSDP2 holds as the flat shard (a private attribute: evidence only)
        flat = layer._get_fsdp_state()._fsdp_param_group.fsdp_params[0]._sharded_param_data
    except AttributeError:
        pass
    held = "?" if flat is None else f"{type(flat).__name__} {flat.dtype} {tensor_bytes(flat) / MiB:.0f} MiB"
    result = {"name": name, "shard": type(local).__name__, "fp8": buffer_bytes(local), "kept": kept,
              "unshard": unshard_peak, "flat": held}
    del layer, local, flat
    return result


def main() -> int:
    warnings.filterwarnings("ignore")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    m, k = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else WEIGHT
    mesh = init_device_mesh("cuda", (world,))
    rows = [measure("Float8BlockScaling", recipe.Float8BlockScaling(), mesh, m, k),
            measure("Float8CurrentScaling (control)", recipe.Float8CurrentScaling(), mesh, m, k)]
    blockwise = rows[0]
    defect = blockwise["kept"] > blockwise["fp8"] // 2
    if rank == 0:
        versions = f"TE {transformer_engine.__version__}, torch {torch.__version__}"
        print(f"te.Linear {m}x{k} bf16 on {world} ranks, {versions}, {torch.cuda.get_device_name()}")
        for r in rows:
            print(f"  {r['name']}: shard {r['shard']}, {r['fp8'] / MiB:.0f} MiB of buffers; allocated after a "
                  f"forward+backward, grads freed: +{r['kept'] / MiB:.0f} MiB; FSDP2's flat shard: {r['flat']}; the "
                  f"first unshard's peak: {r['unshard'] / MiB:.0f} MiB above the built layer")
        print("DEFECT: FSDP2 keeps a dequantized copy of the Float8BlockwiseQTensor shard" if defect
              else "OK: the Float8BlockwiseQTensor shard is not kept twice")
    dist.destroy_process_group()
    return 1 if defect else 0


if __name__ == "__main__":
    timer = threading.Timer(TIMEOUT_S, lambda: (print(f"HANG: no result within {TIMEOUT_S} s", flush=True),
                                                os._exit(1)))
    timer.daemon = True
    timer.start()
    sys.exit(main())
