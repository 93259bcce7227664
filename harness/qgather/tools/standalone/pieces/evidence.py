"""What a rank found at one unshard: the evidence of qgather's report (which buffer, how many valid
elements, which rows); the verdict over every rank is pieces.launch.verdict."""

from __future__ import annotations

import itertools

import torch


def compare(got: dict, want: dict, got_values: torch.Tensor, want_values: torch.Tensor, row0: int) -> list[str]:
    """Evidence lines, none when every gathered buffer equals the golden's bit for bit (row0: the
    first global row of what this rank gathered)."""
    lines = []
    for name, expected in want.items():
        actual = got[name].detach().cpu()
        if actual.shape != expected.shape:
            lines.append(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            continue
        differ = (actual.view(torch.uint8) != expected.view(torch.uint8)).view(*expected.shape, -1).any(-1)  # elements
        if differ.any():
            lines.append(f"{name}: {int(differ.sum())} of {differ.numel()} valid elements differ")
    if lines and got_values.shape == want_values.shape and want_values.numel():
        differ = got_values.cpu() != want_values
        rows = (differ.any(1).nonzero().flatten() + row0).tolist()
        lines.append(f"dequantized weight: {int(differ.sum())} elements differ, max |diff| "
                     f"{float((got_values.cpu() - want_values).abs().max()):.3g}; rows {row_ranges(rows)}")
    return lines


def row_ranges(rows: list[int]) -> str:
    """[0, 1, 2, 7] -> '0-2, 7'."""
    runs = [[row for _, row in run] for _, run in itertools.groupby(enumerate(rows), key=lambda p: p[1] - p[0])]
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs) or "none"
