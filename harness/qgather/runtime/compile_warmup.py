"""Preloaded by the forkserver of a run that has compiled cases (qgather.runtime.helpers.preload_compile_warmup):
one torch.compile of a small function, so that every rank forked from the forkserver starts with
Dynamo, AOTAutograd and the modules they load lazily already initialised. A rank's first compile
otherwise costs it about 1.3 s of CPU against 0.1 s for its next (measured on the 2-core CI machine),
and a run forks a dozen ranks or more.

On meta tensors: no kernel runs, so no intra-op thread pool exists in the forkserver to be forked.
Dynamo's caches are reset afterwards: a rank starts with nothing compiled. On a CUDA (or ROCm) build of
torch it does nothing (the forkserver must not initialise CUDA, and no GPU host measured it), nor where
the warm-up fails: the ranks then pay their own first compile, as without it.
"""

from __future__ import annotations

import torch


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w) * 2


def warm_up() -> bool:
    """One aot_eager compile (forward and backward traced) on meta tensors; whether it ran."""
    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return False
    try:
        x = torch.empty(4, 8, device="meta")
        w = torch.empty(3, 8, device="meta", requires_grad=True)
        torch.compile(_linear, backend="aot_eager")(x, w)
    except Exception:  # noqa: BLE001 - a warm-up that fails leaves each rank its own first compile
        return False
    finally:
        torch._dynamo.reset()
    return True


WARMED = warm_up()
