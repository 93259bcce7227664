"""A transport shim for gloo, which rejects float8 dtypes in all-gather ("Invalid scalar type").

Implementations such as torchao hand float8 tensors to FSDP2's all-gather. Under gloo, the shim
reinterprets those tensors' bytes as uint8 for the collective and leaves the output holding the
same bytes: what the implementation computes and what arrives are untouched, only the dtype that
the backend sees changes (the patch itself: qgather.instruments.patches.float8_all_gathers_as_bytes).
NCCL gathers float8 natively and never needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from qgather.instruments.patches import float8_all_gathers_as_bytes


@contextlib.contextmanager
def float8_as_bytes_on_gloo(group: dist.ProcessGroup | None = None) -> Iterator[bool]:
    """Active only when the group's backend is gloo; yields whether the shim is in effect."""
    if not dist.is_initialized() or dist.get_backend(group) != "gloo":
        yield False
        return
    with float8_all_gathers_as_bytes():
        yield True
