"""Repro (docs/findings.md): TransformerEngine 2.20.2. A te.autocast whose recipe the GPU cannot run
(NVFP4BlockScaling below sm_100, MXFP8BlockScaling on sm_90) raises from __enter__ after it has
already enabled TE's global FP8 state; __exit__ never runs, so the process stays in FP8 mode and
every module built afterwards believes it runs under FP8 autocast.

    PYTHONPATH=/opt/te/site python3 docs/repro/te_refused_autocast_leaves_fp8_enabled.py   # on sm_90
"""

import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.quantization import FP8GlobalStateManager


def main() -> None:
    print("before: FP8 enabled =", FP8GlobalStateManager.is_fp8_enabled())
    try:
        with te.autocast(enabled=True, recipe=recipe.NVFP4BlockScaling()):
            pass
        print("NVFP4 autocast accepted (sm_100 or newer): nothing to show on this GPU")
        return
    except AssertionError as exc:
        print("te.autocast(NVFP4BlockScaling) refused:", str(exc).strip())
    print("after the refused autocast: FP8 enabled =", FP8GlobalStateManager.is_fp8_enabled(),
          "recipe =", type(FP8GlobalStateManager.get_fp8_recipe()).__name__)
    with te.quantized_model_init(enabled=True, recipe=recipe.DelayedScaling()):
        module = te.Linear(64, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    print("a DelayedScaling te.Linear built afterwards, never run: fp8 =", module.fp8,
          "_extra_state bytes =", module.state_dict()["_extra_state"].numel())


if __name__ == "__main__":
    main()
