"""A transport shim for gloo, which rejects float8 dtypes in all-gather ("Invalid scalar type").

Implementations such as torchao hand float8 tensors to FSDP2's all-gather. Under gloo, the shim
reinterprets those tensors' bytes as uint8 for the collective and leaves the output holding the
same bytes: what the implementation computes and what arrives are untouched, only the dtype that
the backend sees changes. NCCL gathers float8 natively and never needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

_FLOAT8 = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
}
_PATCHED = ("all_gather_single", "all_gather_into_tensor")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def _bytewise(original):
    def gather(output, input, *args, **kwargs):
        return original(_as_bytes(output), _as_bytes(input), *args, **kwargs)

    return gather


@contextlib.contextmanager
def float8_as_bytes_on_gloo(group: dist.ProcessGroup | None = None) -> Iterator[bool]:
    """Active only when the group's backend is gloo; yields whether the shim is in effect."""
    if not dist.is_initialized() or dist.get_backend(group) != "gloo":
        yield False
        return
    saved = {name: getattr(dist, name) for name in _PATCHED if hasattr(dist, name)}
    for name, original in saved.items():
        setattr(dist, name, _bytewise(original))
    try:
        yield True
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
