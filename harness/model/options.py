"""Checks of the run options that need no torch, so that the CLI refuses bad ones before it imports torch."""

from __future__ import annotations


def options_problem(case_timeout: float | None, device: str, backend: str) -> str | None:
    """Why these run options cannot work on this host, checked before anything runs (None: fine)."""
    import math

    if case_timeout is not None and not (math.isfinite(case_timeout) and case_timeout > 0):
        return f"--case-timeout must be a finite number of seconds > 0, got {case_timeout}"
    if device == "cuda" or backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            asked = "--device cuda" if device == "cuda" else "--backend nccl"
            return f"{asked}: no CUDA GPU on this host (torch.cuda.is_available() is False)"
    return None
