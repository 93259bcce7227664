"""What this process can run of TransformerEngine: importable at all, the GPU's compute capability,
and TE's own availability checks (asked before any kernel runs: on sm_90 TE's MXFP8 quantize
returns garbage instead of raising)."""

from __future__ import annotations

import torch


def te_import_error() -> str | None:
    """None when transformer_engine.pytorch imports, else one line saying why not."""
    try:  # TE is optional: imported here to learn whether it can be
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        return f"transformer_engine unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return None


def compute_capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def sm_name() -> str:
    major, minor = compute_capability()
    return f"sm_{major}{minor}"


def has_nvfp4_kernels() -> bool:
    return compute_capability() >= (10, 0)


def mxfp8_unavailable_reason() -> str | None:
    """TE's own reason why MXFP8 cannot run on this GPU, or None."""
    from transformer_engine.pytorch.quantization import is_mxfp8_available  # TE is optional: imported on use

    available, reason = is_mxfp8_available(return_reason=True)
    return None if available else f"TE: {reason}"


#: recipe class name -> TE's availability check for it (transformer_engine.pytorch.quantization)
_RECIPE_CHECKS = {"MXFP8BlockScaling": "is_mxfp8_available", "Float8BlockScaling": "is_fp8_block_scaling_available",
                  "NVFP4BlockScaling": "is_nvfp4_available"}


def recipe_unavailable_reason(recipe) -> str | None:
    """TE's own reason why `recipe` cannot run under te.autocast on this GPU, or None. Asked before
    entering te.autocast: TE 2.20's autocast_enter enables its global FP8 state and only then
    asserts availability, so a refused autocast leaves the process in FP8 mode (docs/findings.md)."""
    from transformer_engine.pytorch import quantization  # TE is optional: imported on use

    checks = ["is_fp8_available", _RECIPE_CHECKS.get(type(recipe).__name__)]
    for name in filter(None, checks):
        available, reason = getattr(quantization, name)(return_reason=True)
        if not available:
            return reason
    return None
