"""Repro (docs/findings.md): TransformerEngine 2.20.2, DelayedScaling. A te.Linear's `_extra_state`
is empty until its first forward under te.autocast, then holds the amax history; a checkpoint
saved by torch.distributed.checkpoint after training cannot be loaded into a freshly built module.

    PYTHONPATH=/opt/te/site python3 docs/repro/te_delayed_dcp_extra_state.py     # one GPU, no process group
"""

import tempfile

import torch
import torch.distributed.checkpoint as dcp
import transformer_engine.pytorch as te
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from transformer_engine.common import recipe


def build(r):
    with te.quantized_model_init(enabled=True, recipe=r):
        return te.Linear(64, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")


def main() -> None:
    for name in ("DelayedScaling", "Float8CurrentScaling"):
        r = getattr(recipe, name)()
        trained = build(r)
        before = trained.state_dict()["_extra_state"].numel()
        with te.autocast(enabled=True, recipe=r):
            trained(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16))
        after = trained.state_dict()["_extra_state"].numel()
        fresh = build(r)
        print(f"{name}: _extra_state bytes: fresh {before}, after one forward {after}, "
              f"another fresh module {fresh.state_dict()['_extra_state'].numel()}")
        with tempfile.TemporaryDirectory() as path:
            dcp.save(trained.state_dict(), checkpoint_id=path, no_dist=True)
            state = fresh.state_dict()
            try:
                dcp.load(state, checkpoint_id=path, no_dist=True)
                fresh.load_state_dict(state)
                print(f"{name}: DCP load into a fresh module: ok")
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the failure is what this shows
                print(f"{name}: DCP load into a fresh module: {type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[-1][:300]}")


if __name__ == "__main__":
    main()
