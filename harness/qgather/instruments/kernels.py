"""What qgather's Triton kernels share (fused.py's buffer comparisons, fused_values.py's golden blocks):
Triton imported where a module's kernels are first built, and a launch that returns the sum of the
kernel's per-program counts, or None once Triton could not run in this process (said once, as a
RuntimeWarning: the callers then compare another way, with the same counts).

Every kernel takes its int64 count first, zeroed, and adds each program's count to it atomically:
one launch per comparison and no reduction after it (a reduction's launch cost the host as much
as the kernel's own).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import torch

# Why Triton's kernels cannot run in this process, once they could not: a property of the process (its
# torch build, its Triton, its driver), not of a case, so it is kept where the kernels are launched.
TRITON_BROKEN: list[str] = []


def built(make: Callable[..., SimpleNamespace]) -> Callable[[], SimpleNamespace | None]:
    """`make(triton, tl)`'s kernels, built on the first call and kept; None where Triton does not
    import. Triton is imported here, not at the top of a module: it is an optional dependency (torch's
    CUDA builds bring it), and a process that never compares on a GPU would pay its import."""

    @functools.cache
    def kernels() -> SimpleNamespace | None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return make(triton, tl)

    return kernels


def counted(kernel, grid: tuple[int, ...], device: torch.device, *args, **constexprs) -> torch.Tensor | None:
    """Launch `kernel` over `grid` with a zeroed int64 count first, then `args`; the programs' counts
    added up in it (a 0-dim int64 tensor on `device`), or None where Triton cannot run."""
    if TRITON_BROKEN:
        return None
    count = torch.zeros((), dtype=torch.int64, device=device)
    try:
        kernel[grid](count, *args, **constexprs)
    except Exception as exc:  # noqa: BLE001 - the caller compares another way, the same counts
        note_broken(exc, TRITON_BROKEN, "the Triton comparison")
        return None
    return count


def note_broken(exc: Exception, flag: list[str], what: str) -> None:
    """Remember in `flag` that `what` cannot run in this process; warn the first time."""
    flag.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
    if len(flag) == 1:
        warnings.warn(f"qgather: {what} cannot run here ({flag[0]}); large tensors are compared another way "
                      "(the same counts)", RuntimeWarning, stacklevel=4)
