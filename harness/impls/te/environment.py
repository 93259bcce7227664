"""What this process can run of TransformerEngine: importable at all, the GPU's compute capability,
and TE's own availability checks (asked before any kernel runs: on sm_90 TE's MXFP8 quantize
returns garbage instead of raising)."""

from __future__ import annotations

import torch


def te_import_error() -> str | None:
    """None when transformer_engine.pytorch imports, else one line saying why not."""
    try:
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
    from transformer_engine.pytorch.quantization import is_mxfp8_available

    available, reason = is_mxfp8_available(return_reason=True)
    return None if available else f"TE: {reason}"
