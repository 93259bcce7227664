"""The note a rank leaves as it enters an all-gather (`whereabouts.note`): how many bytes it handed the
collective, and which all-gather of its case that is. Written by the wire check, read by the pool (a
stalled case whose ranks handed one all-gather different sizes) and by a HANG's headline: one format,
kept here."""

from __future__ import annotations

from collections.abc import Mapping

KEY = "all-gather"


def text(nbytes: int, call: int) -> str:
    """The note's value: the bytes this rank handed its `call`-th all-gather of the case."""
    return f"{nbytes} bytes from this rank (all-gather {call} of the case)"


def parse(value: str) -> tuple[int, int | None] | None:
    """(bytes, call) from a note's value; call None in a note without it; None if it is not one."""
    head, _, rest = value.partition(" bytes from this rank")
    if not head.isdigit() or not _:
        return None
    call = rest.removeprefix(" (all-gather ").partition(" ")[0]
    return int(head), int(call) if call.isdigit() else None


def unequal_sizes(notes: Mapping[int, Mapping[str, str]]) -> dict[int, int]:
    """Per rank, the bytes handed the all-gather, when the ranks that noted one handed different sizes
    to the same call of the case (empty otherwise: sizes alike, calls apart, or nothing noted)."""
    sent = {rank: parsed for rank, facts in notes.items() if KEY in facts and (parsed := parse(facts[KEY]))}
    if len({size for size, _ in sent.values()}) < 2 or len({call for _, call in sent.values()}) > 1:
        return {}
    return {rank: size for rank, (size, _) in sent.items()}
