"""One-line text for reports and refusals: a reason's first line, cut at a word with "..." where it
is too long, never mid-word (the one place this is decided)."""

from __future__ import annotations

ELLIPSIS = "..."


def clip(text: str, width: int) -> str:
    """The first line of `text`, at most `width` characters, cut after a whole word with "...".

    Example:
        >>> clip("rank 0 raised RuntimeError: The size of tensor a must match", 40)
        'rank 0 raised RuntimeError: The size...'
    """
    stripped = (text or "").strip()
    line = stripped.splitlines()[0] if stripped else ""
    if len(line) <= width:
        return line
    room = line[: max(width - len(ELLIPSIS), 0) + 1]
    cut = room.rfind(" ")
    kept = room[:cut] if cut > 0 else room[:-1]  # one word longer than the width: cut inside it
    return kept.rstrip(" ,;:") + ELLIPSIS
