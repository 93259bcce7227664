"""`qgather baseline update`'s minimal diff: the file's own text with only what changed edited in place
(a stale pattern's element removed, an emptied finding's table removed, new untriaged patterns and groups
added at the end of their array or of the file); its header, comments, quoting and one-line arrays are
kept. Where an edit cannot be placed with certainty, or the edited text does not read back as the
updated findings, the whole file is written in the canonical layout instead (qgather.pytest_plugin.baseline.dumps).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from qgather.pytest_plugin.baseline import BaselineError, Finding, Update, dump_tables, dumps, findings_of_text

_TABLE = re.compile(r"^\[\[issue\]\][ \t]*$", re.M)


def updated_text(text: str, before: Sequence[Finding], result: Update, name: str) -> str:
    """The baseline file `text` (whose findings are `before`) after `result`, edited in place where it can be."""
    if not result.changed:
        return text
    try:
        edited = _edit(text, before, result)
        if findings_of_text(edited) == list(result.findings):
            return edited
    except (_CannotPlace, BaselineError):
        pass
    return dumps(result.findings, name)


class _CannotPlace(Exception):
    """An edit whose place in the text is not certain."""


def _edit(text: str, before: Sequence[Finding], result: Update) -> str:
    starts = [m.start() for m in _TABLE.finditer(text)]
    if len(starts) != len(before):
        raise _CannotPlace
    blocks = [text[:starts[0]] if starts else text] + [
        text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
    after = {f.title: f for f in result.findings}
    out = [blocks[0]]
    for finding, block in zip(before, blocks[1:]):
        kept = after.get(finding.title)
        if kept is None:
            continue  # every pattern went stale: the table goes
        for pattern in finding.cases:
            if pattern not in kept.cases:
                block = _remove(block, pattern)
        new = [p for p in kept.cases if p not in finding.cases]
        out.append(_append(block, new) if new else block)
    known = {f.title for f in before}
    added = [f for f in result.findings if f.title not in known]
    if added:
        tail = "".join(out)
        tail = tail if tail.endswith("\n\n") or not tail else tail.rstrip("\n") + "\n\n"
        out = [tail, dump_tables(added)]
    return "".join(out)


def _remove(block: str, pattern: str) -> str:
    literal = re.escape(json.dumps(pattern))
    for form in (rf"^[ \t]*{literal}[ \t]*,?[ \t]*\n", rf"{literal}[ \t]*,[ \t]*", rf",[ \t]*{literal}"):
        edited, count = re.subn(form, "", block, count=1, flags=re.M)
        if count:
            return edited
    raise _CannotPlace


def _append(block: str, patterns: list[str]) -> str:
    match = re.search(r"^cases[ \t]*=[ \t]*\[[ \t]*\n(.*?)^\][ \t]*$", block, re.M | re.S)
    if match is None:
        raise _CannotPlace
    at = match.end(1)
    return block[:at] + "".join(f"    {json.dumps(p)},\n" for p in patterns) + block[at:]
