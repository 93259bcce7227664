"""`qgather case` and `qgather repro`: run cases by id and print their reports; `repro` adds the
environment and the command that reruns the case from a fresh shell, or with `--standalone` writes
the case as a script without qgather in it (qgather.tools.standalone) instead of running it."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from qgather.cli.common import USAGE_ERROR, add_run_options, refusing_in_one_line, run_options, shutdown_pools, usage
from qgather.cli.interrupts import load_torch
from qgather.errors import UsageError
from qgather.model.case import CaseSpec  # torch-free: a case id is read before torch loads
from qgather.model.names import external_module
from qgather.model.repro import repro_command
from qgather.paths import missing_user_module

if TYPE_CHECKING:  # imported when a case runs: the CLI starts without torch
    from qgather.engine.run import RunOptions


@refusing_in_one_line("case")
def main_case(argv: Sequence[str]) -> int:
    """Run single cases by id and print their reports: the one-command reproduction."""
    parser = argparse.ArgumentParser(prog="qgather case", description=main_case.__doc__)
    parser.add_argument("case_ids", nargs="+", metavar="CASE_ID",
                        help="e.g. reference:nvfp4_2d:136x64:bf16:ws8:gather:s0")
    add_run_options(parser)
    args = parser.parse_args(argv)
    try:
        specs = [CaseSpec.parse(case_id) for case_id in args.case_ids]  # a malformed id: said before torch loads
    except UsageError as exc:
        return usage("case", str(exc))
    problem = next(filter(None, map(unloadable_adapter, specs)), None)
    if problem:
        return usage("case", problem)
    options = run_options("case", args)
    if options is None:
        return USAGE_ERROR
    load_torch()  # deferred: torch, once the options and ids are checked
    from qgather.engine.run import run_case
    from qgather.impls import UnknownImplementationError

    failed = 0
    try:
        for spec in specs:
            report = run_case(spec, options)
            print(report.render())
            failed += not report.passed
    except (UsageError, UnknownImplementationError) as exc:  # a bad case id, format, implementation or world
        return usage("case", str(exc))
    finally:
        shutdown_pools()
    return 1 if failed else 0


@refusing_in_one_line("repro")
def main_repro(argv: Sequence[str]) -> int:
    """Run one case and print its full report, the environment, and the command that reproduces it."""
    parser = argparse.ArgumentParser(prog="qgather repro", description=main_repro.__doc__)
    parser.add_argument("case_id", metavar="CASE_ID")
    parser.add_argument("--standalone", action="store_true",
                        help="write the case as a script that imports only torch, the library under test and the "
                             "standard library (torchrun, or python FILE where the library runs on the CPU); "
                             "nothing runs")
    parser.add_argument("-o", "--output", metavar="FILE", help="--standalone: the script's path (default: stdout)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.output and not args.standalone:
        return usage("repro", "-o/--output names the --standalone script's file: add --standalone")
    if args.standalone:
        return _write_standalone(args.case_id, args.output)
    try:
        spec = CaseSpec.parse(args.case_id)  # a malformed id: said before torch loads
    except UsageError as exc:
        return usage("repro", str(exc))
    if unloadable_adapter(spec):
        return usage("repro", unloadable_adapter(spec))
    options = run_options("repro", args)
    if options is None:
        return USAGE_ERROR
    load_torch()  # deferred: torch, once the options and the id are checked
    from qgather.engine.run import run_case
    from qgather.impls import UnknownImplementationError, adapter_module

    try:
        report = run_case(spec, options)
    except (UsageError, UnknownImplementationError) as exc:
        return usage("repro", str(exc))
    finally:
        shutdown_pools()
    print(report.render())
    print()
    for line in environment_lines(options, spec.world_size):
        print(line)
    command = repro_command(spec.id, options.backend, options.device, options.case_timeout, standalone=True,
                            adapter_module=adapter_module(spec.impl))
    print(f"reproduce: {command}")
    return 0 if report.passed else 1


def unloadable_adapter(spec: CaseSpec) -> str | None:
    """Why the case's adapter (a user's package.module:object) certainly cannot be imported from here, said
    without torch and naming the case, not an option the user did not give; None: it may load."""
    module = external_module(spec.impl)
    missing = module and missing_user_module(module)
    return f"case {spec.id}: implementation {spec.impl!r}: {missing}" if missing else None


def _write_standalone(case_id: str, output: str | None) -> int:
    """`qgather repro ID --standalone [-o FILE]`: the script on stdout or in FILE; a case no template
    covers is one line and exit 4."""
    from qgather.tools.standalone import how_to_run, render  # deferred: torch

    try:
        text = render(case_id)
    except UsageError as exc:  # a bad case id, or one no template covers
        return usage("repro", str(exc))
    if output is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        return usage("repro", f"cannot write {output}: {exc.strerror}")
    print(f"wrote {output}: run it with {how_to_run(case_id, output)}", file=sys.stderr)
    return 0


def environment_lines(options: RunOptions, world_size: int) -> list[str]:
    """python, torch, TransformerEngine, torchao versions, the GPU (or none) and the backend used."""
    import torch  # deferred: the CLI's torch import (a case has run by now)

    lines = [f"python: {platform.python_version()} ({sys.executable})", f"torch: {torch.__version__}"]
    for label, module in (("transformer_engine", "transformer_engine"), ("torchao", "torchao")):
        lines.append(f"{label}: {_module_version(module)}")
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        lines.append(f"gpu: {torch.cuda.device_count()} x {', '.join(names)}")
    else:
        lines.append("gpu: no GPU")
    lines.append(f"device: {options.device_type()}; backend: {options.backend_for(world_size)}")
    return lines


def _module_version(module: str) -> str:
    for dist in (module, module.replace("_", "-")):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"
