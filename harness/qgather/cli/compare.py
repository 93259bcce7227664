"""`qgather compare BEFORE AFTER`: two runs (report folders or verdicts.json files) case by case, the way
an upgrade is gated: what it fixed, what it broke (qgather.model.run_diff says how each case id is
classed). Prints the summary grouped by implementation x format x world size, writes compare.md (for
$GITHUB_STEP_SUMMARY) and compare.json, and exits 1 when a change named by --fail-on occurred.

Nothing here imports torch: a bad input is refused, and two runs compared, in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from qgather.cli.common import OptionRefused, usage
from qgather.model.run_diff import LEFT_OUT, Change, RunDiff, RunDiffError, RunView, compare

REPORT_FILE = "verdicts.json"  # what a run's --report-dir holds, and a folder argument is read for
DEFAULT_OUT = os.path.join("reports", "compare")
DEFAULT_FAIL_ON = (Change.REGRESSED,)
LISTED = 50  # case ids listed per change in the terminal; compare.md lists up to MD_LISTED, compare.json all
MD_LISTED = 200  # a job summary has a size limit
FAILED = 1
OK = 0


def parse_fail_on(text: str) -> tuple[Change, ...]:
    """`--fail-on regressed,verdict-changed`: the changes that fail the comparison (`none`: none do)."""
    if text.strip() == "none":
        return ()
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    known = {c.value: c for c in Change if c is not Change.UNCHANGED}
    unknown = [t for t in tokens if t not in known]
    if unknown or not tokens:
        raise OptionRefused(f"--fail-on {text}: {unknown[0] if unknown else 'empty'} is not a change; "
                            f"choose from {', '.join(known)} (comma-separated) or none")
    return tuple(dict.fromkeys(known[t] for t in tokens))


class _OneLineParser(argparse.ArgumentParser):
    """argparse's refusals (a missing or extra argument) as one line, exit 4, like every bad input here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise OptionRefused(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="qgather compare", description=main.__doc__,
        epilog="exit status: 0 no change --fail-on names, 1 some, 4 bad input (README's \"Exit codes\")")
    parser.add_argument("before", metavar="BEFORE", help="the run before: a --report-dir folder or its verdicts.json")
    parser.add_argument("after", metavar="AFTER", help="the run after, the same way")
    parser.add_argument("--fail-on", type=parse_fail_on, default=DEFAULT_FAIL_ON, metavar="CHANGES",
                        help="the changes that fail the comparison, comma-separated, from "
                             f"{', '.join(c.value for c in Change if c is not Change.UNCHANGED)}; "
                             "or none (default: regressed)")
    parser.add_argument("--report-dir", default=DEFAULT_OUT,
                        help=f"where compare.md and compare.json go (default: {DEFAULT_OUT})")
    return parser


def main(argv: Sequence[str]) -> int:
    """Compare two runs of the suite case by case: fixed, regressed, verdict changed, evidence changed,
    unchanged, only before, only after; the two environments side by side."""
    try:
        args = build_parser().parse_args(argv)
    except OptionRefused as exc:
        return usage("compare", exc.message)
    problem = _unwritable(args.report_dir)
    if problem:
        return usage("compare", problem)
    try:
        diff = compare(read_run(args.before), read_run(args.after))
    except RunDiffError as exc:
        return usage("compare", str(exc))
    failing = diff.failing(args.fail_on)
    status = FAILED if failing else OK
    _write(args.report_dir, diff, args.fail_on, status)
    print("\n".join(terminal_lines(diff, args.fail_on, failing, args.report_dir)))
    return status


def read_run(path: str) -> RunView:
    """The run of a report folder (its verdicts.json) or of a verdicts.json; RunDiffError, one line, otherwise."""
    file = os.path.join(path, REPORT_FILE) if os.path.isdir(path) else path
    if not os.path.exists(file):
        where = f"{path} has no {REPORT_FILE}" if os.path.isdir(path) else f"{path}: no such file or folder"
        raise RunDiffError(f"{where} (a run's --report-dir, or its {REPORT_FILE})")
    try:
        with open(file) as fh:
            data = json.load(fh)
    except OSError as exc:
        raise RunDiffError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDiffError(f"{file}: not JSON ({exc})") from None
    return RunView.from_json(data, file)


def _unwritable(folder: str) -> str | None:
    existing = folder
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    existing = existing or "."
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        return f"--report-dir {folder}: cannot write there ({existing} is not a writable folder)"
    return None


# ------------------------------------------------------------------ the terminal
def terminal_lines(diff: RunDiff, fail_on: Sequence[Change], failing: Sequence[object], written: str) -> list[str]:
    """The summary: the environments, the groups' counts, the cases that changed, where the reports
    went, the verdict line."""
    lines = [f"qgather compare: {diff.before.source} -> {diff.after.source}", ""]
    lines += _environment_lines(diff)
    lines += ["", *_group_lines(diff), ""]
    for change in Change:
        if change is Change.UNCHANGED or not diff.count(change):
            continue
        listed = diff.of(change)
        lines.append(f"{change.label} ({len(listed)}):")
        lines += [f"  {c.case}: {c.describe()}" for c in listed[:LISTED]]
        if len(listed) > LISTED:
            lines.append(f"  ... and {len(listed) - LISTED} more (compare.json lists them all)")
    lines.append(counts_line(diff))
    lines.append(f"compare.md, compare.json: {written}")
    lines.append(verdict_line(fail_on, failing))
    return lines


def _environment_lines(diff: RunDiff) -> list[str]:
    rows = [("", "before", "after")] + [
        (label, old, new) for (label, old), (_, new) in zip(diff.before.environment, diff.after.environment)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            + ("   (changed)" if row[0] and row[1] != row[2] else "") for row in rows]


_COLUMN = {Change.VERDICT_CHANGED: "verdict", Change.EVIDENCE_CHANGED: "evidence"}  # the rest: their label


def _group_lines(diff: RunDiff) -> list[str]:
    """The groups with a change, one row each; those without, one line (compare.md has every group)."""
    changed = {group: counts for group, counts in diff.groups().items() if set(counts) != {Change.UNCHANGED}}
    same = len(diff.groups()) - len(changed)
    ids = sum(counts[Change.UNCHANGED] for group, counts in diff.groups().items() if group not in changed)
    if not changed:
        return [f"implementation x format x world size: all {same} groups unchanged throughout ({_ids(ids)})"]
    names = [f"{impl} {fmt} ws{ws}" for impl, fmt, ws in changed]
    width = max(len(name) for name in ["implementation format world size", *names])
    head = "implementation format world size".ljust(width) + "".join(f"{_COLUMN.get(c, c.label):>12}" for c in Change)
    lines = [head]
    for name, counts in zip(names, changed.values()):
        lines.append(name.ljust(width) + "".join(f"{counts.get(c, 0) or '.':>12}" for c in Change))
    if same:
        lines.append(f"and {same} groups unchanged throughout ({_ids(ids)})")
    return lines


def counts_line(diff: RunDiff) -> str:
    """`264 case ids in both runs: 1 fixed, 0 regressed, ...; 3 left out: 3 only before, 0 only after`."""
    counts = diff.counts()
    kept = ", ".join(f"{counts[c]} {c.label}" for c in Change if c not in LEFT_OUT)
    left = sum(counts[c] for c in LEFT_OUT)
    tail = (f"; {left} left out of the comparison: {counts[Change.ONLY_BEFORE]} only before, "
            f"{counts[Change.ONLY_AFTER]} only after" if left else "; the same case ids in both runs")
    return f"{_ids(diff.common)} in both runs: {kept}{tail}"


def verdict_line(fail_on: Sequence[Change], failing: Sequence[object]) -> str:
    """The last line: whether the comparison fails, and under which --fail-on."""
    named = ",".join(c.value for c in fail_on) or "none"
    if failing:
        return f"qgather compare: FAILED: {_ids(len(failing))} with a change --fail-on {named} names"
    return f"qgather compare: passed: no case id with a change --fail-on {named} names"


def _ids(n: int) -> str:
    return f"{n} case id" + ("" if n == 1 else "s")


# ------------------------------------------------------------------ compare.md, compare.json
def _write(folder: str, diff: RunDiff, fail_on: Sequence[Change], status: int) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "compare.md"), "w") as fh:
        fh.write(render_markdown(diff, fail_on, status))
    with open(os.path.join(folder, "compare.json"), "w") as fh:
        json.dump(as_json(diff, fail_on, status), fh, indent=1)
        fh.write("\n")


def render_markdown(diff: RunDiff, fail_on: Sequence[Change], status: int) -> str:
    """compare.md: the verdict line, the environments, the groups' counts, the changed cases."""
    failing = diff.failing(fail_on)
    lines = ["## qgather compare", "", f"`{diff.before.source}` → `{diff.after.source}`", "",
             f"**{verdict_line(fail_on, failing).removeprefix('qgather compare: ')}** (exit {status})", "",
             counts_line(diff), "", "| | before | after |", "|---|---|---|"]
    lines += [f"| {label} | {_cell(old)} | {_cell(new)}{' (changed)' if old != new else ''} |"
              for (label, old), (_, new) in zip(diff.before.environment, diff.after.environment)]
    lines += ["", "| implementation | format | world size | " + " | ".join(c.label for c in Change) + " |",
              "|---|---|---:|" + "---:|" * len(Change)]
    for (impl, fmt, ws), counts in diff.groups().items():
        lines.append(f"| {impl} | {fmt} | {ws} | " + " | ".join(str(counts.get(c, 0)) for c in Change) + " |")
    for change in Change:
        if change is Change.UNCHANGED or not diff.count(change):
            continue
        listed = diff.of(change)
        lines += ["", f"### {change.label} ({len(listed)})", ""]
        lines += [f"- `{c.case}`: {_cell(c.describe())}" for c in listed[:MD_LISTED]]
        if len(listed) > MD_LISTED:
            lines.append(f"- ... and {len(listed) - MD_LISTED} more (compare.json lists them all)")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def as_json(diff: RunDiff, fail_on: Sequence[Change], status: int) -> dict[str, Any]:
    """compare.json: both runs' sources and environments, the counts, the groups, every case id's change."""
    return {
        "before": {"source": diff.before.source, "environment": dict(diff.before.environment)},
        "after": {"source": diff.after.source, "environment": dict(diff.after.environment)},
        "fail_on": [c.value for c in fail_on],
        "exit_status": status,
        "common": diff.common,
        "counts": {c.value: n for c, n in diff.counts().items()},
        "groups": [{"implementation": impl, "format": fmt, "world_size": ws,
                    "counts": {c.value: counts.get(c, 0) for c in Change}}
                   for (impl, fmt, ws), counts in diff.groups().items()],
        "cases": [{"case": c.case, "change": c.change.value, "describe": c.describe(),
                   "before": _side(c.before), "after": _side(c.after)} for c in diff.changes],
    }


def _side(entry: Any) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"verdict": entry.verdict.value, "passed": entry.passed, "reason": entry.reason}
