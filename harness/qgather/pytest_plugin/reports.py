"""Run reports: verdicts.json (every case's record, the counts, the environment) and verdicts.md
(a CI job summary: the verdict matrix implementation x format x world size x shape class x
configuration -> counts per verdict, then the failures and the known issues), both built from one
`RunResults` (qgather.pytest_plugin.results), so that they count what the terminal summary counts.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import sys
from collections import Counter
from typing import Any

import pytest
import torch

from qgather import __version__
from qgather.errors import first_line
from qgather.model.case_record import CaseRecord, Outcome
from qgather.model.verdict import Verdict
from qgather.pytest_plugin import placement
from qgather.pytest_plugin.options import Settings
from qgather.pytest_plugin.results import ALSO_RAN, OTHER_TESTS, Row, RunResults

MATRIX_KEYS = ("implementation", "format", "world_size", "shape_class", "configuration")
FAILURES_SHOWN = 200  # a job summary has a size limit; verdicts.json has them all


def build(results: RunResults, settings: Settings, session: pytest.Session) -> dict[str, Any]:
    """Everything verdicts.json holds; verdicts.md is rendered from it."""
    config = session.config
    return {
        "qgather_version": __version__,
        "session": {
            "device": settings.run.device,
            "backend": settings.run.backend,
            "case_timeout": settings.run.case_timeout,
            "baseline": settings.baseline_path,
            "impls": list(settings.impls),
            "command": " ".join([_program(), shlex.join(sys.argv[1:])]),
            "pytest_args": list(config.invocation_params.args),
            "exit_status": int(session.exitstatus),
        },
        "environment": environment(),
        "headline": results.headline(),
        "outcomes": results.outcomes,
        "pytest": results.pytest,
        "rows": {row.name.lower(): dict(results.rows.get(row, {})) for row in Row},
        "other_tests": results.other_tests,
        "failing_other_tests": list(results.failing_other_tests),
        "verdicts": results.verdicts,
        "matrix": matrix(results.cases),
        "where_ran": placement.as_json(results.cases),  # world size -> nccl/cuda, gloo/cuda, ..., skipped
        "failures": [_failure(r) for r in results.failures],
        "known_issues": [_failure(r) for r in results.known_issues],
        "cases": [r.to_dict() for r in results.cases],
        "also_ran": [r.to_dict() for r in results.also_ran],
    }


def _program() -> str:
    main = sys.argv[0] if sys.argv else "pytest"
    for package in ("pytest", "qgather"):
        if main.endswith(os.path.join(package, "__main__.py")):
            return f"python -m {package}"
    return os.path.basename(main)


def matrix(cases: tuple[CaseRecord, ...]) -> list[dict[str, Any]]:
    """Rows of (implementation, format, world size, shape class, configuration) with the verdict
    counts and pytest outcome counts of their cases."""
    rows: dict[tuple, dict[str, Any]] = {}
    for record in cases:
        key = tuple(getattr(record, k) for k in MATRIX_KEYS)
        row = rows.setdefault(key, {**dict(zip(MATRIX_KEYS, key)), "verdicts": Counter(), "outcomes": Counter()})
        row["verdicts"][record.verdict.value] += 1
        if record.outcome is not None:
            row["outcomes"][record.outcome.value] += 1
    return [{**row, "verdicts": dict(row["verdicts"]), "outcomes": dict(row["outcomes"])}
            for _key, row in sorted(rows.items(), key=lambda kv: tuple(map(_sort_key, kv[0])))]


def _sort_key(value: object) -> tuple:
    return (0, value, "") if isinstance(value, int) else (1, 0, str(value))


def _failure(record: CaseRecord) -> dict[str, Any]:
    keep = ("case", "verdict", "reason", "repro", "report", "known_issue", "outcome")
    data = record.to_dict()
    return {k: data[k] for k in keep}


def environment() -> dict[str, Any]:
    """Versions and hardware, without importing anything not already imported (importing
    TransformerEngine on a broken install can abort the process that writes the report)."""
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformer_engine": _version("transformer_engine"),
        "torchao": _version("torchao"),
        "gpus": gpus or "no GPU",
    }


def _version(module: str) -> str:
    loaded = sys.modules.get(module)
    if loaded is not None and getattr(loaded, "__version__", None):
        return str(loaded.__version__)
    for dist in (module, module.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception as exc:  # noqa: BLE001 - broken metadata: say so, do not fail the report
            return f"unknown ({type(exc).__name__})"
    return "not installed"


# ------------------------------------------------------------------ Markdown
def render_markdown(data: dict[str, Any]) -> str:
    """verdicts.md: the headline, pytest's counts row by row, the matrix, the failures, the known issues."""
    lines = ["## qgather verdicts", "", _headline(data), "", *_reconciliation(data), ""]
    lines += _matrix_table(data["matrix"])
    lines += _where_ran_table(data.get("where_ran", {}))
    lines += _failures_section(data["failures"])
    lines += _other_failures_section(data["failing_other_tests"])
    lines += _known_section(data["known_issues"])
    env = data["environment"]
    gpus = env["gpus"] if isinstance(env["gpus"], str) else ", ".join(sorted(set(env["gpus"])))
    lines += ["", f"<sub>qgather {data['qgather_version']}; python {env['python']}; torch {env['torch']}; "
                  f"torchao {env['torchao']}; transformer_engine {env['transformer_engine']}; {gpus}; "
                  f"{_cell(data['session'].get('command', ''))}</sub>", ""]
    return "\n".join(lines)


def _where_ran_table(table: dict[str, dict[str, int]]) -> list[str]:
    """Per world size, how many cases ran on NCCL, gloo on CUDA, ..., and how many were skipped."""
    if not table:
        return []
    columns = [c for c in placement.COLUMNS if any(counts.get(c) for counts in table.values())]
    lines = ["", "### Where the cases ran", "", "| world size | " + " | ".join(columns) + " |",
             "|---:|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join([size, *(str(counts.get(c, 0)) for c in columns)]) + " |"
              for size, counts in table.items()]
    return lines


def _headline(data: dict[str, Any]) -> str:
    outcomes, session = data["outcomes"], data["session"]
    total = sum(outcomes.values())
    parts = [f"{n} {o}" for o, n in outcomes.items() if n or o in (Outcome.PASSED.value, Outcome.FAILED.value)]
    where = f"device {session.get('device', 'auto')}, backend {session.get('backend', 'auto')}"
    baseline = f", baseline `{session['baseline']}`" if session.get("baseline") else ""
    red = session.get("exit_status", 0) or outcomes["failed"] or outcomes["xpassed"]
    verdict = "**red**" if red else "**green**"
    if data.get("incomplete"):  # the cases that did not run are counted nowhere above
        collected = data.get("collected_cases")
        verdict = ("**incomplete (interrupted)** while collecting the cases, before any ran" if collected is None
                   else f"**incomplete (interrupted)** after {total} of {collected or total} cases")
    return f"{verdict}: {total} cases - {', '.join(parts)} ({where}{baseline})"


def _reconciliation(data: dict[str, Any]) -> list[str]:
    """pytest's final line, row by row: which tests are one case each and which are not."""
    pytest_counts = {k: n for k, n in data["pytest"].items() if n}
    head = ["tests", *pytest_counts, "total"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for row in Row:
        counts = data["rows"].get(row.name.lower(), {})
        if row is not Row.CASES and not sum(counts.values()):
            continue
        cells = [str(counts.get(k, 0)) for k in pytest_counts]
        lines.append("| " + " | ".join([row.value, *cells, str(sum(counts.values()))]) + " |")
    cells = [f"**{n}**" for n in pytest_counts.values()]
    lines.append("| " + " | ".join(["**pytest's final line**", *cells, f"**{sum(pytest_counts.values())}**"]) + " |")
    other, also = data["other_tests"], len(data["also_ran"])
    if other:
        tests = "1 other test" if other == 1 else f"{other} other tests"
        line = f"{tests} {OTHER_TESTS}"
        if also:
            cases = "1 more case" if also == 1 else f"{also} more cases"
            line += f"; they ran {cases}, not counted above, {ALSO_RAN} (verdicts.json: `also_ran`)"
        lines += ["", line + "."]
    return lines


def _matrix_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["No case ran."]
    ran = [r for r in rows if set(r["verdicts"]) != {Verdict.SKIPPED.value}]
    skipped = [r for r in rows if r not in ran]
    lines = _table(ran) if ran else ["No case ran: every case was skipped."]
    if skipped:
        total = sum(r["verdicts"][Verdict.SKIPPED.value] for r in skipped)
        lines += ["", f"<details><summary>Skipped only ({total} cases in {len(skipped)} rows)</summary>", "",
                  *_table(skipped), "", "</details>"]
    return lines


def _table(rows: list[dict[str, Any]]) -> list[str]:
    present = [v.value for v in Verdict if any(r["verdicts"].get(v.value) for r in rows)]
    outcomes = [o for o in ("failed", "xfailed") if o == "failed" or any(r["outcomes"].get(o) for r in rows)]
    head = ["implementation", "format", "ws", "shape class", "configuration", *present, *outcomes]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---|---|" + "---:|" * (len(present) + len(outcomes))]
    for row in rows:
        counts = [str(row["verdicts"].get(v, "")) for v in present]
        counts += [str(row["outcomes"].get(o, "") or "") for o in outcomes]
        cells = [_cell(row["implementation"]), row["format"], str(row["world_size"]), row["shape_class"],
                 row["configuration"]]
        lines.append("| " + " | ".join([*cells, *counts]) + " |")
    return lines


def _failures_section(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"### Failures ({len(rows)})", "", "| case | verdict | reason | reproduce |", "|---|---|---|---|"]
    for row in rows[:FAILURES_SHOWN]:
        verdict = row["verdict"] + (" (baseline stale)" if row.get("known_issue") else "")
        lines.append(f"| `{row['case']}` | {verdict} | {_cell(first_line(row['reason'], 200))} | `{row['repro']}` |")
    if len(rows) > FAILURES_SHOWN:
        lines.append(f"\n... and {len(rows) - FAILURES_SHOWN} more in verdicts.json")
    return lines


def _other_failures_section(nodeids: list[str]) -> list[str]:
    if not nodeids:
        return []
    lines = ["", f"### Failed other tests ({len(nodeids)})", ""]
    lines += [f"- `{nodeid}`" for nodeid in nodeids[:FAILURES_SHOWN]]
    return lines


def _known_section(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"<details><summary>Known issues from the baseline ({len(rows)} xfailed)</summary>", "",
             "| case | verdict | known issue | link |", "|---|---|---|---|"]
    for row in rows[:FAILURES_SHOWN]:
        issue = row.get("known_issue") or {}
        lines.append(f"| `{row['case']}` | {row['verdict']} | {_cell(issue.get('reason', ''))} | "
                     f"{_cell(issue.get('link', ''))} |")
    return [*lines, "", "</details>"]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write(directory: str, data: dict[str, Any]) -> None:
    """verdicts.json and verdicts.md into `directory`, each replaced whole (never half written)."""
    os.makedirs(directory, exist_ok=True)
    write_text(os.path.join(directory, "verdicts.json"), json.dumps(data, indent=1, default=str) + "\n")
    write_text(os.path.join(directory, "verdicts.md"), render_markdown(data))


def write_text(path: str, text: str) -> None:
    """Replace the file at `path` whole with `text` (never half written)."""
    partial = path + ".partial"
    with open(partial, "w") as fh:
        fh.write(text)
    os.replace(partial, path)


def drop_nameless_testcases(path: str) -> int:
    """Remove the `<testcase>` elements without a name that pytest's junitxml writes for the test an
    interrupt cut short (JUnit readers reject them; pytest's `tests` count leaves them out already);
    how many went."""
    import xml.etree.ElementTree as ET  # deferred: only an interrupted run's junit.xml is read back

    tree = ET.parse(path)
    dropped = 0
    for suite in tree.getroot().iter("testsuite"):
        nameless = [case for case in suite.findall("testcase") if not case.get("name")]
        for case in nameless:
            suite.remove(case)
        dropped += len(nameless)
    if dropped:
        tree.write(path, encoding="utf-8", xml_declaration=True)
    return dropped
