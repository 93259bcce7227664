"""TransformerEngine: a refused te.autocast leaves TE's global FP8 state enabled for the rest of the process

A te.autocast whose recipe the GPU cannot run (NVFP4BlockScaling below sm_100, MXFP8BlockScaling on
sm_90) raises from __enter__ after it has already enabled TE's global FP8 state; __exit__ never runs,
so the process stays in FP8 mode and every module built afterwards believes it runs under FP8
autocast. Exit 1 while that is so, 0 once the refusal leaves the state as it found it (or the GPU
runs the recipe: nothing to show there).

    PYTHONPATH=/opt/te/site python3 FILE     # one GPU below sm_100, no process group
"""

import os
import sys
import threading

import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

TIMEOUT_S = int(os.environ.get("REPRO_TIMEOUT_S", "30"))  # the deadline (HANG after it)


def main() -> int:
    print("before: FP8 enabled =", FP8GlobalStateManager.is_fp8_enabled())
    try:
        with te.autocast(enabled=True, recipe=recipe.NVFP4BlockScaling()):
            pass
        print("NVFP4 autocast accepted (sm_100 or newer): nothing to show on this GPU")
        return 0
    except AssertionError as exc:
        print("te.autocast(NVFP4BlockScaling) refused:", str(exc).strip())
    leaked = FP8GlobalStateManager.is_fp8_enabled()
    print("after the refused autocast: FP8 enabled =", leaked,
          "recipe =", type(FP8GlobalStateManager.get_fp8_recipe()).__name__)
    with te.quantized_model_init(enabled=True, recipe=recipe.DelayedScaling()):
        module = te.Linear(64, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    print("a DelayedScaling te.Linear built afterwards, never run: fp8 =", module.fp8,
          "_extra_state bytes =", module.state_dict()["_extra_state"].numel())
    print("DEFECT: the refused autocast left TE's FP8 state enabled" if leaked else "OK: the state was restored")
    return 1 if leaked else 0


if __name__ == "__main__":
    timer = threading.Timer(TIMEOUT_S, lambda: (print(f"HANG: no result within {TIMEOUT_S} s", flush=True),
                                                os._exit(1)))
    timer.daemon = True
    timer.start()
    sys.exit(main())
