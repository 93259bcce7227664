"""TransformerEngine: DelayedScaling + FusedAdam(master_weights=True): the backward uses a stale FP8 transpose

A te.Linear built under quantized_model_init(recipe=DelayedScaling()) holds a Float8Tensor weight with
a cached transpose (`_transpose`) for the backward's dgrad. After te.optimizers.FusedAdam(...,
master_weights=True).step() writes the new FP8 data, the cached transpose still holds the old step's
bytes while `_transpose_invalid` stays False, and the next backward computes dgrad from it. One GPU,
no FSDP (with FSDP2 the gathered weight is rebuilt from the data alone, so the sharded run is right
and a single-GPU run is not). Exit 1 while the transpose is stale after a step, 0 once it is not.

    PYTHONPATH=/opt/te/site python3 FILE     # one GPU, no process group
"""

import os
import sys
import threading

import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe

TIMEOUT_S = int(os.environ.get("REPRO_TIMEOUT_S", "30"))  # the deadline (HANG after it)
SHAPE = (256, 256)  # (out_features, in_features), bf16


def stale(weight) -> tuple[int, int]:
    """Elements of the cached transpose that differ from the data's transpose (TE rebuilds it from
    the data when `_transpose_invalid`; a held one must equal it)."""
    if weight._transpose is None or weight._transpose_invalid:
        return 0, weight._data.numel()
    held = weight._transpose.view(torch.uint8)
    return int((held != weight._data.view(torch.uint8).t().contiguous()).sum()), held.numel()


def main() -> int:
    torch.manual_seed(0)
    rec = recipe.DelayedScaling()
    with te.quantized_model_init(enabled=True, recipe=rec):
        layer = te.Linear(SHAPE[1], SHAPE[0], bias=False, params_dtype=torch.bfloat16, device="cuda")
    optimizer = te.optimizers.FusedAdam(layer.parameters(), lr=1e-2, master_weights=True)
    x = torch.randn(32, SHAPE[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    worst = 0
    for step in range(3):
        with te.autocast(enabled=True, recipe=rec):
            y = layer(x)
        y.float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        differ, total = stale(layer.weight)
        print(f"after step {step + 1}: stale_elements={differ}/{total} invalid={layer.weight._transpose_invalid}")
        worst = max(worst, differ)
    print("DEFECT: the backward's FP8 transpose is stale after FusedAdam's step" if worst
          else "OK: the transpose follows the data")
    return 1 if worst else 0


if __name__ == "__main__":
    timer = threading.Timer(TIMEOUT_S, lambda: (print(f"HANG: no result within {TIMEOUT_S} s", flush=True),
                                                os._exit(1)))
    timer.daemon = True
    timer.start()
    sys.exit(main())
