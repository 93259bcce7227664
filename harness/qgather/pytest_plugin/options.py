"""The plugin's command-line options: each declared once (qgather.suite.options holds the ones the
CLI shares) and parsed where it is declared, so that the hooks after them only see checked values;
`Settings` is what the session's processes read of them (`settings(config)`).

A bad value is one line, `ERROR: --formats: unknown format 'fp7'; ...`, and exit status 4: the
parsers' OptionError becomes a `pytest.UsageError`, which argparse lets through to pytest's main.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from qgather.engine.run import RunOptions
from qgather.model.case_record import KnownIssue
from qgather.pytest_plugin.baseline import BaselineError, load
from qgather.suite.options import RUN_OPTIONS, SELECTION_OPTIONS, OptionError, OptionSpec, gpu_problem, joined_impls

GROUP = "quantized all-gather harness"  # `qgather run --help` finds qgather's options under this title


def _for_pytest(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, reporting an OptionError the way pytest reports a usage error: one line."""

    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except OptionError as exc:  # a ValueError, which argparse would turn into "invalid value"
            raise pytest.UsageError(str(exc)) from None

    parsed.__name__ = parse.__name__
    return parsed


def parse_baseline(path: str) -> str:
    """--baseline: a known-issues TOML file that loads (the path; `Settings.baseline` holds its entries)."""
    try:
        load(path, f"--baseline {path}")
    except BaselineError as exc:
        raise OptionError(str(exc)) from None
    return path


PLUGIN_OPTIONS = (
    OptionSpec("--qgather-summary", "print the verdict summary table", default=False, action="store_true"),
    OptionSpec("--qgather-json", "write every case's record to this JSON file (rewritten as cases finish)",
               metavar="PATH"),
    OptionSpec("--report-dir", "write verdicts.md (a CI job summary), verdicts.json and junit.xml to DIR",
               metavar="DIR"),
    OptionSpec("--baseline", "known-issues TOML: listed failing cases are strict xfails, listed passing cases fail",
               parse_baseline, metavar="FILE"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    """qgather's options, in one group (see `qgather run --help`)."""
    group = parser.getgroup("qgather", GROUP)
    for spec in (*SELECTION_OPTIONS, *RUN_OPTIONS, *PLUGIN_OPTIONS):
        group.addoption(spec.flag, **spec.keywords(_for_pytest))


@dataclass(frozen=True)
class Settings:
    """The session's qgather options, parsed: read by collection, the fixture and the reports."""

    impls: tuple[str, ...]  # --impl, or the default
    impls_named: bool  # --impl was given
    formats: tuple[str, ...] | None
    world_sizes: tuple[int, ...] | None
    scenarios: tuple[str, ...] | None
    exhaustive: bool
    run: RunOptions
    summary: bool
    json_path: str | None
    report_dir: str | None
    baseline_path: str | None
    baseline: tuple[KnownIssue, ...]

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        """The parsed options; refuses (pytest.UsageError) a GPU asked for on a host without one."""
        option = config.getoption
        run = RunOptions(backend=option("--backend"), device=option("--device"), case_timeout=option("--case-timeout"))
        problem = gpu_problem(run.device, run.backend)
        if problem:
            raise pytest.UsageError(problem)
        baseline_path = option("--baseline")
        return cls(
            impls=joined_impls(option("--impl")),
            impls_named=bool(option("--impl")),
            formats=option("--formats"),
            world_sizes=option("--world-sizes"),
            scenarios=option("--scenarios"),
            exhaustive=option("--exhaustive"),
            run=run,
            summary=option("--qgather-summary"),
            json_path=option("--qgather-json") or None,
            report_dir=option("--report-dir") or None,
            baseline_path=baseline_path,
            baseline=tuple(load(baseline_path)) if baseline_path else (),
        )

    def stale_baseline_update(self) -> str:
        """How to rewrite the baseline after a listed case started to pass."""
        update = (f"qgather baseline update --from {os.path.join(self.report_dir or 'reports', 'verdicts.json')} "
                  f"--file {self.baseline_path}")
        return f"run `{update}`" if self.report_dir else f"rerun with --report-dir reports, then `{update}`"


settings_key = pytest.StashKey[Settings]()


def settings(config: pytest.Config) -> Settings:
    """The session's parsed qgather options (set in pytest_configure, on every process of the session).

    Example, in a case module's own parametrization:
        >>> formats = settings(metafunc.config).formats or ("nvfp4_2d",)
    """
    return config.stash[settings_key]
