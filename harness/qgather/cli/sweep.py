"""`qgather sweep`: explore shapes x world sizes of one implementation and format, group the
failures by (verdict, signature), and shrink each group to a minimal case with the command that
reproduces it.

This module is the command line (input checks, output); the search is qgather.tools.exploration.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import TextIO

import torch

from qgather.cli.arguments import sweep_parser
from qgather.cli.common import USAGE_ERROR, run_options, shutdown_pools, usage
from qgather.errors import UsageError
from qgather.formats import FORMATS
from qgather.impls import UnknownImplementationError, get_impl
from qgather.model.case import DTYPES, CaseSpec
from qgather.model.report import CaseReport
from qgather.model.repro import repro_command
from qgather.tools.arguments import MAX_REAL_WORLD, MAX_ROWS
from qgather.tools.exploration import (
    Lattice,
    Progress,
    Runner,
    SweepResult,
    candidate_rows,
    explore,
    group_key,
)


@dataclass
class SweepInput:
    impl: str
    fmt: str
    dtype: str
    seed: int
    scenario: str
    budget_s: float
    lattice: Lattice
    virtual: bool


class InputProblem(UsageError):
    """Bad input; the message is the one line printed."""


def _ints(text: str, option: str, low: int, high: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputProblem(f"{option} takes comma-separated integers, got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise InputProblem(f"{option} values must be integers in {low}..{high}, got {text!r}")
    return sorted(set(values))


def check_input(args: argparse.Namespace) -> SweepInput:
    """The checked sweep, or InputProblem with one line."""
    if args.fmt not in FORMATS:
        raise InputProblem(f"--format: unknown format {args.fmt!r}; known: {', '.join(FORMATS)}")
    try:
        impl = get_impl(args.impl)
    except UnknownImplementationError as exc:
        raise InputProblem(f"--impl: {exc}") from None
    if args.dtype not in DTYPES:
        raise InputProblem(f"--dtype: {args.dtype!r} is not one of {', '.join(DTYPES)}")
    fmt = FORMATS[args.fmt]
    world_sizes = _ints(args.world_sizes, "--world-sizes", 1, MAX_REAL_WORLD)
    default_rows = 4 * max(fmt.row_block, 16) + 2
    max_rows = _ints(args.max_rows or str(default_rows), "--max-rows", 1, MAX_ROWS)[0]
    cols = _ints(args.cols, "--cols", 1, MAX_ROWS)
    seed = _ints(args.seed, "--seed", 0, 2**31 - 1)[0]
    try:
        budget = float(args.budget_s)
    except ValueError:
        budget = math.nan
    if not (math.isfinite(budget) and budget > 0):
        raise InputProblem(f"--budget-s must be a finite number of seconds > 0, got {args.budget_s!r}")
    probe = CaseSpec(args.impl, args.fmt, (max_rows, cols[-1]), args.dtype, world_sizes[-1], args.scenario, seed)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    reason = impl.skip_reason(probe, device)
    if reason:
        raise InputProblem(f"{args.impl} cannot run {args.scenario} cases of {args.fmt} here: {reason}")
    lattice = Lattice(candidate_rows(fmt.row_block, world_sizes, max_rows), cols, world_sizes, fmt.k_multiple)
    return SweepInput(args.impl, args.fmt, args.dtype, seed, args.scenario, budget, lattice,
                      "virtual" in impl.scenarios)


def repro(report: CaseReport, args: argparse.Namespace) -> str:
    return repro_command(report.spec.id, args.backend, args.device, args.case_timeout)


def render(result: SweepResult, args: argparse.Namespace) -> list[str]:
    explored = ", ".join(f"{phase} {done}/{total}" for phase, (done, total) in result.explored.items())
    lines = [f"explored: {explored}" + (" (budget reached)" if result.budget_hit else "")]
    if not result.groups:
        return [*lines, "no failure groups"]
    lines.append(f"{len(result.groups)} failure group(s):")
    for i, group in enumerate(result.groups, 1):
        found = "virtual" if group.source == "virtual" else f"{group.source} (virtual passes)"
        lines.append(f"[{i}] {group.verdict}  count {len(group.points)}  found by {found}")
        lines.append(f"    signature: {group.signature}")
        if group.source == "virtual" and group.confirmation is not None:
            confirmed = group_key(group.confirmation) == group.key
            lines.append(f"    {group.confirmation.spec.scenario}: "
                         + ("confirmed" if confirmed else f"not confirmed ({group.confirmation.verdict.value})"))
        minimal = group.minimal
        note = "" if group.shrink_complete else " (shrink stopped by the budget)"
        lines.append(f"    minimal: {minimal.spec.id}{note}")
        lines.append(f"    reason: {minimal.reason}")
        lines.append(f"    reproduce: {repro(minimal, args)}")
    return lines


def main(argv: list[str] | None = None, stream: TextIO | None = None) -> int:
    stream = stream or sys.stdout
    args = sweep_parser().parse_args(argv)
    options = run_options("sweep", args)
    if options is None:
        return USAGE_ERROR
    try:
        sweep = check_input(args)
    except InputProblem as exc:
        return usage("sweep", str(exc))
    lattice = sweep.lattice
    stream.write(f"sweep {sweep.impl} {sweep.fmt} {sweep.dtype} s{sweep.seed}: {len(lattice.points())} candidates "
                 f"(rows {lattice.rows[0]}..{lattice.rows[-1]}, cols {','.join(map(str, lattice.cols))}, world "
                 f"sizes {','.join(map(str, lattice.world_sizes))}); virtual first, then {sweep.scenario}\n")
    runner = Runner(sweep.impl, sweep.fmt, sweep.dtype, sweep.seed, sweep.scenario, options)
    try:
        result = explore(runner, lattice, sweep.budget_s, Progress(stream), sweep.virtual)
    finally:
        shutdown_pools()
    stream.write("\n".join(render(result, args)) + "\n")
    stream.flush()
    return 1 if result.groups else 0
