"""The golden of FP8 block scaling, one power-of-two scale per 128x128 tile, E4M3 (TE
Float8BlockScaling, Float8BlockwiseQTensor): qgather.formats.fp8_block, rowwise buffers only."""

from __future__ import annotations

import torch


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The single-device quantization of the full weight: each tile scaled by 2^floor(log2(448 / amax))."""
    m, k = w.shape
    mt, kt = -(-m // 128), -(-k // 128)
    tiles = torch.nn.functional.pad(w.float(), (0, kt * 128 - k, 0, mt * 128 - m)).view(mt, 128, kt, 128)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.tensor([448.0]) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, 2.0**127), scale)
    scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)  # round down to a power of two
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    data = (tiles * scale.view(mt, 1, kt, 1)).view(mt * 128, kt * 128)[:m, :k]
    return {"rowwise_data": data.to(torch.float8_e4m3fn).view(torch.uint8),
            "rowwise_scale_inv": torch.tensor([1.0]) / scale}


def dequantize(q: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 values of the quantized weight."""
    data = q["rowwise_data"].view(torch.float8_e4m3fn).float()
    m, k = data.shape
    factor = q["rowwise_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :k]
    return data * factor
