"""What a rank found at one unshard: the evidence of qgather's report (which buffer, how many valid
elements, the rows from the first to the last that differ; no dequantized line when bytes that differ
dequantize alike, as in qgather's report); the verdict over every rank is pieces.launch.verdict."""

# ruff: noqa: F821 -- the script defines `dequantize` (a golden piece, see __init__)

from __future__ import annotations

import torch


def compare(got: dict, want: dict, shape: tuple[int, ...], row0: int) -> list[str]:
    """Evidence lines, none when every gathered buffer equals the golden's bit for bit (shape: the
    gathered weight's; row0: its first global row)."""
    lines = [f"{name}: shape {tuple(got[name].shape)}, expected {tuple(w.shape)}" for name, w in want.items()
             if got[name].shape != w.shape]
    for name, expected in [(name, w) for name, w in want.items() if got[name].shape == w.shape]:
        differ = (got[name].view(torch.uint8) != expected.view(torch.uint8)).view(*expected.shape, -1).any(-1)
        if differ.any():
            lines.append(f"{name}: {int(differ.sum())} of {differ.numel()} valid elements differ")
    got_values, want_values = dequantize(got, shape), dequantize(want, shape)
    if lines and got_values.shape == want_values.shape and bool((got_values != want_values).any()):
        differ = (got_values != want_values).reshape(-1, shape[-1])
        rows = (differ.any(1).nonzero().flatten() + row0).tolist()
        lines.append(f"dequantized weight: {int(differ.sum())} elements differ, max |diff| "
                     f"{float((got_values - want_values).abs().max()):.3g}; rows {rows[0]}-{rows[-1]}")
    return lines
