"""Large tensors that wait in host memory while a case does something else on the device.

A case of a large weight (`qgather bench gpu`'s 8192x28672) holds, at some moment, the full weight,
its golden, the library's one-device module and FSDP2's gathered buffers; the device only needs
some of them at a time. What waits goes to pinned host memory (fast to copy back) and comes back
block by block, or whole, when a check reads it. Small tensors never move: for them the copies
would cost more than they save.
"""

from __future__ import annotations

import contextlib

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


class WayBack:
    """Host copies (pinned) on their way back to a device, beside the case's own work: each is copied
    into a device tensor allocated from a copy stream's own pool, so that the copies wait on nothing
    queued on the case's stream and never write over memory its queued work still reads. The case's
    stream waits for the copies queued before a mark (`wait_for`) or for every one (`arrived`)
    before reading them. Off CUDA (the tests' CPU stand-ins) the copies are plain and the waits nothing."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device, self.stream = device, stream
        self.tensors: dict[str, torch.Tensor] = {}
        self._marks: list[torch.cuda.Event | None] = []

    def copy(self, name: str, source: torch.Tensor, first: int = 0, last: int | None = None) -> None:
        """Queue the copy of rows [first, last) of `source` (its first dimension; last None: to its end)
        into the device tensor `name`, allocated on its first copy."""
        with self._on_stream():
            if name not in self.tensors:
                self.tensors[name] = torch.empty(source.shape, dtype=source.dtype, device=self.device)
            self.tensors[name][first:last].copy_(source[first:last], non_blocking=True)

    def mark(self) -> int:
        """A mark after every copy queued so far; its index, for `wait_for`."""
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        self._marks.append(event)
        return len(self._marks) - 1

    def wait_for(self, mark: int) -> None:
        """The case's (current) stream waits for the copies queued before mark `mark`."""
        event = self._marks[mark]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def arrived(self) -> dict[str, torch.Tensor]:
        """The case's stream waits for every copy; the device tensors, as used by that stream too (so that
        their memory goes back to the copy stream's pool only once the case's reads of it are done)."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for tensor in self.tensors.values():
                tensor.record_stream(current)
        return self.tensors

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


def copy_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of its own for copies to `device` (None off CUDA); its holder keeps it, so that the
    memory its copies were allocated from is found again by the next ones."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None
