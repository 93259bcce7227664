"""Large tensors that wait in host memory while a case does something else on the device.

A case of a large weight (`qgather bench gpu`'s 8192x28672) holds, at some moment, the full weight,
its golden, the library's one-device module and FSDP2's gathered buffers; the device only needs
some of them at a time. What waits goes to pinned host memory (fast to copy back) and comes back
block by block, or whole, when a check reads it. Small tensors never move: for them the copies
would cost more than they save.
"""

from __future__ import annotations

import torch

#: a tensor (or golden) of at least this many bytes on a GPU may wait on the host
PARK_BYTES = 1 << 26


def worth_parking(nbytes: int, device: torch.device) -> bool:
    """Whether `nbytes` on `device` are worth moving to the host while they are not read."""
    return device.type == "cuda" and nbytes >= PARK_BYTES


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in pinned host memory (the same shape, dtype and bits)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


def park_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when it is small or not on a GPU, else its pinned host copy: the caller
    drops its own reference to the device tensor to free the memory."""
    if not worth_parking(tensor.numel() * tensor.element_size(), tensor.device):
        return tensor
    return pinned_copy(tensor)
