"""The golden of FP8 block scaling, one power-of-two scale per 128x128 tile, E4M3 (TE
Float8BlockScaling, Float8BlockwiseQTensor): qgather.formats.fp8_block, rowwise buffers only."""

from __future__ import annotations

import torch


def quantize(w: torch.Tensor, per_tensor_amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """The single-device quantization: each tile scaled by 2^floor(log2(448 / its amax)) (the whole
    weight's amax is for per-tensor formats, not this one)."""
    w = w.reshape(-1, w.shape[-1])
    m, k = w.shape
    mt, kt = -(-m // 128), -(-k // 128)
    tiles = torch.nn.functional.pad(w.float(), (0, kt * 128 - k, 0, mt * 128 - m)).view(mt, 128, kt, 128)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = (torch.tensor([448.0]) / amax).clamp(max=2.0**127)
    scale = torch.where(amax == 0, 1.0, (scale.view(torch.int32) & 0x7F800000).view(torch.float32))  # 2^k, rounded down
    data = (tiles * scale.view(mt, 1, kt, 1)).view(mt * 128, kt * 128)[:m, :k]
    return {"rowwise_data": data.to(torch.float8_e4m3fn).view(torch.uint8),
            "rowwise_scale_inv": torch.tensor([1.0]) / scale}


def dequantize(q: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values of the quantized weight."""
    data, (m, k) = q["rowwise_data"].view(torch.float8_e4m3fn).float(), q["rowwise_data"].shape
    return data * q["rowwise_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :k]
