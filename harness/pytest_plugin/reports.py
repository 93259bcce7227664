"""Run reports: the verdict matrix (implementation x format x world size x shape class x
configuration -> counts per verdict) as Markdown for a CI job summary and as JSON with the
environment, built from the per-case records the pytest plugin collects.

A record is a plain dict (it travels from xdist workers to the controller in a test report's
user_properties): see `case_record`. The pytest plugin adds `outcome` (pytest's outcome of the
test that checked the case) and, under a baseline, `known_issue`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import sys
from collections import Counter

from qgather.model.case import CaseSpec, shard_layout
from qgather.model.report import CaseReport
from qgather.model.verdict import Verdict

OUTCOMES = ("passed", "failed", "xfailed", "xpassed", "skipped")
MATRIX_KEYS = ("impl", "format", "world_size", "shape_class", "configuration")
FAILURES_SHOWN = 200  # a job summary has a size limit; verdicts.json has them all


def shape_class(spec: CaseSpec) -> str:
    """aligned / misaligned / unholdable (the policy's view of the shape), then `uneven` and
    `zero-row` when FSDP2's dim-0 split is uneven or leaves a rank without rows."""
    from qgather.formats import FORMATS, FormatError
    from qgather.model.policy import expectation

    fmt = FORMATS.get(spec.fmt)
    if fmt is None:
        return "unknown format"
    try:
        fmt.check(spec.shape, spec.torch_dtype)
    except FormatError:
        alignment = "unholdable"
    else:
        alignment = "aligned" if expectation(spec).aligned else "misaligned"
    layout = shard_layout(spec)
    tags = [] if layout.even else ["uneven"]
    if any(start == end for start, end in map(layout.dim0_range, range(layout.world_size))):
        tags.append("zero-row")
    return " ".join([alignment, *tags])


def repro_command(case_id: str, backend: str = "auto", device: str = "auto",
                  case_timeout: float | None = None) -> str:
    """`qgather case <id>` with the session options that differ from the defaults."""
    words = ["qgather", "case", case_id]
    if device != "auto":
        words += ["--device", device]
    if backend != "auto":
        words += ["--backend", backend]
    if case_timeout is not None:
        words += ["--case-timeout", repr(case_timeout)]
    return shlex.join(words)


def case_record(report: CaseReport, options) -> dict:
    """What the controller needs of one case (JSON-serializable: it crosses process boundaries)."""
    spec = report.spec
    record = {
        "case": spec.id,
        "verdict": report.verdict.value,
        "passed": report.passed,
        "reason": report.reason,
        "seconds": round(report.duration_s, 3),
        "impl": spec.impl,
        "format": spec.fmt,
        "world_size": spec.world_size,
        "shape_class": _safe_shape_class(spec),
        "configuration": _configuration(spec, options),
        "repro": repro_command(spec.id, options.backend, options.device, options.case_timeout),
    }
    if report.placement:
        record["placement"] = report.placement
        record["configuration"] += f" {report.placement}"
    if not report.passed:
        record["report"] = report.render()
    return record


def _configuration(spec: CaseSpec, options) -> str:
    if spec.scenario == "virtual":  # one process emulates the world: no backend
        return f"virtual {options.device_type()}"
    return f"{spec.scenario} {options.device_type()}/{options.backend_for(spec.world_size)}"


def _safe_shape_class(spec: CaseSpec) -> str:
    try:
        return shape_class(spec)
    except Exception as exc:  # noqa: BLE001 - a report label must never fail a case
        return f"unknown ({type(exc).__name__})"


def unique_cases(records: list[dict]) -> list[dict]:
    """One record per case id: the one a test checked wins over extra runs of the same case."""
    by_id: dict[str, dict] = {}
    for record in records:
        old = by_id.get(record["case"])
        if old is None or record.get("checked") or not old.get("checked"):
            by_id[record["case"]] = record
    return list(by_id.values())


def outcome_counts(cases: list[dict]) -> dict[str, int]:
    """pytest outcomes of the cases that a test checked (one test, one case)."""
    counts = Counter(r["outcome"] for r in cases if r.get("checked") and r.get("outcome"))
    return {o: counts[o] for o in OUTCOMES}


def matrix(cases: list[dict]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for record in cases:
        key = tuple(record.get(k, "?") for k in MATRIX_KEYS)
        row = rows.setdefault(key, {**dict(zip(MATRIX_KEYS, key)), "verdicts": Counter(), "outcomes": Counter()})
        row["verdicts"][record["verdict"]] += 1
        if record.get("outcome"):
            row["outcomes"][record["outcome"]] += 1
    return [{**row, "verdicts": dict(row["verdicts"]), "outcomes": dict(row["outcomes"])}
            for _key, row in sorted(rows.items(), key=lambda kv: tuple(map(_sort_key, kv[0])))]


def _sort_key(value: object) -> tuple:
    return (0, value, "") if isinstance(value, int) else (1, 0, str(value))


def failures(cases: list[dict]) -> list[dict]:
    """Cases that fail the run: pytest failed them, or (extra runs) the policy does not accept them."""
    return [r for r in cases if r.get("outcome") == "failed" or (not r.get("checked") and not r["passed"])]


def known_issues(cases: list[dict]) -> list[dict]:
    return [r for r in cases if r.get("outcome") == "xfailed"]


def build(records: list[dict], session: dict, pytest_counts: dict[str, int]) -> dict:
    """Everything verdicts.json holds; verdicts.md is rendered from it."""
    cases = unique_cases(records)
    return {
        "qgather_version": _qgather_version(),
        "session": session,
        "environment": environment(),
        "outcomes": outcome_counts(cases),
        "pytest": pytest_counts,
        "verdicts": dict(Counter(r["verdict"] for r in cases)),
        "matrix": matrix(cases),
        "failures": [_failure(r) for r in failures(cases)],
        "known_issues": [_failure(r) for r in known_issues(cases)],
        "cases": cases,
    }


def _failure(record: dict) -> dict:
    keep = ("case", "verdict", "reason", "repro", "report", "known_issue", "outcome")
    return {k: record[k] for k in keep if k in record}


def environment() -> dict:
    """Versions and hardware, without importing anything not already imported (importing
    TransformerEngine on a broken install can abort the process that writes the report)."""
    import torch

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


def _qgather_version() -> str:
    from qgather import __version__

    return __version__


# ------------------------------------------------------------------ Markdown
def render_markdown(data: dict) -> str:
    lines = ["## qgather verdicts", "", _headline(data), ""]
    tests = {k: n for k, n in data["pytest"].items() if n}
    if tests != {k: n for k, n in data["outcomes"].items() if n}:  # tests that are not one case each
        lines += ["pytest, all tests: " + ", ".join(f"{n} {k}" for k, n in tests.items()), ""]
    lines += _matrix_table(data["matrix"])
    lines += _failures_section(data["failures"])
    lines += _known_section(data["known_issues"])
    env = data["environment"]
    gpus = env["gpus"] if isinstance(env["gpus"], str) else ", ".join(sorted(set(env["gpus"])))
    lines += ["", f"<sub>qgather {data['qgather_version']}; python {env['python']}; torch {env['torch']}; "
                  f"torchao {env['torchao']}; transformer_engine {env['transformer_engine']}; {gpus}; "
                  f"{_cell(data['session'].get('command', ''))}</sub>", ""]
    return "\n".join(lines)


def _headline(data: dict) -> str:
    outcomes, session = data["outcomes"], data["session"]
    total = sum(outcomes.values())
    parts = [f"{outcomes[o]} {o}" for o in OUTCOMES if outcomes[o] or o in ("passed", "failed")]
    where = f"device {session.get('device', 'auto')}, backend {session.get('backend', 'auto')}"
    baseline = f", baseline `{session['baseline']}`" if session.get("baseline") else ""
    red = session.get("exit_status", 0) or outcomes["failed"] or outcomes["xpassed"]
    verdict = "**red**" if red else "**green**"
    return f"{verdict}: {total} cases - {', '.join(parts)} ({where}{baseline})"


def _matrix_table(rows: list[dict]) -> list[str]:
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


def _table(rows: list[dict]) -> list[str]:
    present = [v.value for v in Verdict if any(r["verdicts"].get(v.value) for r in rows)]
    outcomes = [o for o in ("failed", "xfailed") if o == "failed" or any(r["outcomes"].get(o) for r in rows)]
    head = ["implementation", "format", "ws", "shape class", "configuration", *present, *outcomes]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---|---|" + "---:|" * (len(present) + len(outcomes))]
    for row in rows:
        counts = [str(row["verdicts"].get(v, "")) for v in present]
        counts += [str(row["outcomes"].get(o, "") or "") for o in outcomes]
        cells = [_cell(row["impl"]), row["format"], str(row["world_size"]), row["shape_class"], row["configuration"]]
        lines.append("| " + " | ".join([*cells, *counts]) + " |")
    return lines


def _failures_section(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"### Failures ({len(rows)})", "", "| case | verdict | reason | reproduce |", "|---|---|---|---|"]
    for row in rows[:FAILURES_SHOWN]:
        verdict = row["verdict"] + (" (baseline stale)" if row.get("known_issue") else "")
        lines.append(f"| `{row['case']}` | {verdict} | {_cell(_first_line(row['reason']))} | `{row['repro']}` |")
    if len(rows) > FAILURES_SHOWN:
        lines.append(f"\n... and {len(rows) - FAILURES_SHOWN} more in verdicts.json")
    return lines


def _known_section(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", f"<details><summary>Known issues from the baseline ({len(rows)} xfailed)</summary>", "",
             "| case | verdict | known issue | link |", "|---|---|---|---|"]
    for row in rows[:FAILURES_SHOWN]:
        issue = row.get("known_issue", {})
        lines.append(f"| `{row['case']}` | {row['verdict']} | {_cell(issue.get('reason', ''))} | "
                     f"{_cell(issue.get('link', ''))} |")
    return [*lines, "", "</details>"]


def _first_line(text: str) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= 200 else line[:197] + "..."


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write(directory: str, data: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    _replace(os.path.join(directory, "verdicts.json"), json.dumps(data, indent=1, default=str) + "\n")
    _replace(os.path.join(directory, "verdicts.md"), render_markdown(data))


def _replace(path: str, text: str) -> None:
    partial = path + ".partial"
    with open(partial, "w") as fh:
        fh.write(text)
    os.replace(partial, path)
