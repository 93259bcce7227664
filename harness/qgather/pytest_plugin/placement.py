"""Where a run's cases ran, per world size (NCCL, gloo on CUDA, gloo on the CPU, one process), and
why the others did not: the table the summary prints and verdicts.json keeps, and the GPU job's
gate that fails a run in which a case this host's GPUs could run on NCCL was skipped instead."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from qgather.errors import first_line
from qgather.model.case_record import CaseRecord
from qgather.model.report import UNPLACED
from qgather.model.text import clip

SKIPPED = "skipped"
COLUMNS = ("nccl/cuda", "gloo/cuda", "gloo/cpu", "virtual", UNPLACED, SKIPPED)
REASONS_SHOWN = 8
REASON_WIDTH = 110
_NUMBERS = re.compile(r"\d+")


def by_world_size(records: Sequence[CaseRecord]) -> dict[int, Counter[str]]:
    """World size -> how many of its cases ran where (SKIPPED: not run)."""
    table: dict[int, Counter[str]] = {}
    for record in records:
        table.setdefault(record.world_size, Counter())[record.ran_on or SKIPPED] += 1
    return dict(sorted(table.items()))


def skip_reasons(records: Sequence[CaseRecord]) -> list[tuple[int, str]]:
    """The skipped cases' reasons, grouped (numbers in a reason do not split a group), most first."""
    groups: Counter[str] = Counter()
    example: dict[str, str] = {}
    for record in records:
        if record.ran_on:
            continue
        key = _NUMBERS.sub("N", first_line(record.reason))
        groups[key] += 1
        example.setdefault(key, first_line(record.reason))
    return [(count, example[key]) for key, count in groups.most_common()]


def unplaced_on_gpus(records: Sequence[CaseRecord], gpus: int) -> list[CaseRecord]:
    """Cases skipped for want of a pool although their world size fits this host's `gpus` GPUs."""
    return [r for r in records if r.ran_on == UNPLACED and r.world_size <= gpus]


def table_lines(records: Sequence[CaseRecord]) -> list[str]:
    """The per-world-size table and the grouped skip reasons, for the terminal and verdicts.md."""
    table = by_world_size(records)
    if not table:
        return []
    columns = [c for c in COLUMNS if any(counts[c] for counts in table.values())]
    lines = ["where the cases ran:", f"  {'world size':>10}" + "".join(f"{c:>11}" for c in columns)]
    lines += [f"  {size:>10}" + "".join(f"{counts[c]:>11}" for c in columns) for size, counts in table.items()]
    reasons = skip_reasons(records)
    if reasons:
        lines.append("  skipped, by reason:")
        lines += [f"  {count:>8}  {clip(reason, REASON_WIDTH)}" for count, reason in reasons[:REASONS_SHOWN]]
        if len(reasons) > REASONS_SHOWN:
            rest = reasons[REASONS_SHOWN:]
            lines.append(f"  {sum(count for count, _ in rest):>8}  ({len(rest)} other reasons)")
    return lines


def as_json(records: Sequence[CaseRecord]) -> dict[str, dict[str, int]]:
    """The table for verdicts.json: world size -> column -> count."""
    return {str(size): dict(counts) for size, counts in by_world_size(records).items()}
