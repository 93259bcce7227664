"""What a rank found, and the verdict over every rank: the evidence lines of qgather's report
(which buffer, how many valid elements, which rows) and its verdict names."""

from __future__ import annotations

import hashlib

import torch


def compare(got: dict, want: dict, got_values: torch.Tensor, want_values: torch.Tensor, row0: int) -> list[str]:
    """Evidence lines, none when the gathered buffers equal the golden bit for bit; row0: the first
    global row of what this rank gathered."""
    lines = []
    for name, expected in want.items():
        actual = got[name].detach().cpu()
        if actual.shape != expected.shape:
            lines.append(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            continue
        differ = actual.view(torch.uint8) != expected.view(torch.uint8)
        if expected.dtype == torch.float32:  # count float32 elements, not bytes
            differ = differ.view(*expected.shape, 4).any(-1)
        if differ.any():
            lines.append(f"{name}: {int(differ.sum())} of {differ.numel()} valid elements differ")
    if lines and got_values.shape == want_values.shape and want_values.numel():
        differ = got_values.cpu() != want_values
        rows = (differ.any(1).nonzero().flatten() + row0).tolist()
        biggest = float((got_values.cpu() - want_values).abs().max())
        lines.append(f"dequantized weight: {int(differ.sum())} elements differ, max |diff| {biggest:.3g}; "
                     f"rows {row_ranges(rows)}")
    return lines


def row_ranges(rows: list[int]) -> str:
    """[0, 1, 2, 7] -> '0-2, 7'."""
    spans: list[list[int]] = []
    for row in rows:
        if spans and row == spans[-1][1] + 1:
            spans[-1][1] = row
        else:
            spans.append([row, row])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans) or "none"


def digest(got: dict) -> str:
    """A hash of the gathered bytes: ranks that gathered the same piece must agree on it."""
    h = hashlib.sha256()
    for name in sorted(got):
        h.update(got[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def judge(results: list[dict]) -> tuple[str, list[str]]:
    """The verdict over every rank's {"rank", "label", "lines", "digest"} and the lines that show it
    (one line per distinct finding, naming the ranks that share it)."""
    pieces: dict[str, set] = {}
    found: dict[tuple, list[int]] = {}
    for r in results:
        pieces.setdefault(r["label"], set()).add(r["digest"])
        if r["lines"]:
            found.setdefault((r["label"], *r["lines"]), []).append(r["rank"])
    shown = [f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {label}: {'; '.join(lines)}"
             for (label, *lines), ranks in found.items()]
    if any(len(digests) > 1 for digests in pieces.values()):
        return "RANK_DIVERGENCE", shown or ["ranks gathered different bytes"]
    return ("SILENT_MISMATCH", shown) if shown else ("EXACT", [])
