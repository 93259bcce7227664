"""The golden of FP8 with one per-tensor scale, current scaling, E4M3 (TE Float8CurrentScaling,
torchao tensorwise): qgather.formats.fp8_tensor, in the few lines a script needs."""

from __future__ import annotations

import torch


def quantize(w: torch.Tensor, per_tensor_amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """The single-device quantization: scale = 448 / amax (the whole weight's), saturating cast."""
    amax = per_tensor_amax.float().reshape(1)
    scale = torch.where(amax == 0, 1.0, (torch.tensor([448.0]) / amax).clamp(max=torch.finfo(torch.float32).max))
    data = (w.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return {"data": data, "scale_inv": torch.tensor([1.0]) / scale}


def dequantize(q: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values of the quantized weight."""
    return q["data"].view(torch.float8_e4m3fn).float() * q["scale_inv"]
