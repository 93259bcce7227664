"""The `qgather` command line (also `python -m harness`).

Each subcommand is a thin entry point into the module that owns the concern; they import
lazily so that `qgather --help` stays fast and a missing optional library only affects the
subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCHES = {
    "formats": "harness.formats.bench",
    "runtime": "harness.runtime.bench",
}


def _run_pytest(args: Sequence[str]) -> int:
    import pytest

    return int(pytest.main(list(args)))


def cmd_run(extra: list[str]) -> int:
    """The harness's main job: the case suite on whatever hardware is present."""
    suite = os.path.join(REPO_ROOT, "cases")
    rc = _run_pytest([suite, "-q", "-p", "no:cacheprovider", "--qgather-summary", *extra])
    return 2 if rc == int(_pytest_usage_error()) else rc


def _pytest_usage_error() -> int:
    import pytest

    return int(pytest.ExitCode.USAGE_ERROR)


def cmd_bench(which: list[str]) -> int:
    names = which or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"qgather bench: unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}",
              file=sys.stderr)
        return 2
    rc = 0
    for name in names:
        module = importlib.import_module(BENCHES[name])
        rc = max(rc, int(module.main() or 0))
    return rc


def cmd_module(module_name: str, extra: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(extra) or 0)


def cmd_case(argv: list[str]) -> int:
    """Run single cases by id and print their reports: the one-command reproduction."""
    from harness.cases import CaseSpec, CaseSpecError
    from harness.engine import CaseInputError, RunOptions, run_case
    from harness.impls import UnknownImplementationError

    parser = argparse.ArgumentParser(prog="qgather case", description=cmd_case.__doc__)
    parser.add_argument("case_ids", nargs="+", metavar="CASE_ID",
                        help="e.g. reference:nvfp4_2d:136x64:bf16:ws8:gather:s0")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--case-timeout", type=float, default=None)
    args = parser.parse_args(argv)
    from harness.pytest_plugin import options_problem

    problem = options_problem(args.case_timeout, args.device, args.backend)
    if problem:
        print(f"qgather case: {problem}", file=sys.stderr)
        return 2
    options = RunOptions(args.backend, args.device, args.case_timeout)
    failed = 0
    try:
        for case_id in args.case_ids:
            report = run_case(CaseSpec.parse(case_id), options)
            print(report.render())
            failed += not report.passed
    except (CaseSpecError, CaseInputError, UnknownImplementationError) as exc:
        print(f"qgather case: {exc}", file=sys.stderr)
        return 2
    finally:
        _shutdown_pools()
    return 1 if failed else 0


def cmd_gpu_check(argv: list[str]) -> int:
    """What the GPU job will use: devices, backends, optional libraries. Exit 1 without a GPU."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("qgather gpu-check: no GPU found (torch.cuda.is_available() is False); "
              "run `make test` for the CPU suite", file=sys.stderr)
        return 1
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
    print(f"gpus: {count} x {', '.join(names)} (sm {capability}); torch {torch.__version__}")
    print(f"backends: nccl for world sizes <= {count} (one rank per GPU), gloo on CUDA tensors above")
    for module in ("transformer_engine", "torchao"):
        try:
            version = getattr(importlib.import_module(module), "__version__", "?")
            print(f"{module}: {version}")
        except Exception as exc:  # noqa: BLE001 - report any import failure as one line
            print(f"{module}: not available ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    return 0


def _shutdown_pools() -> None:
    try:
        from harness.runtime import shutdown_pools
    except ImportError:
        return
    shutdown_pools()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qgather",
        description="Correctness harness for quantized weight all-gather under PyTorch FSDP2.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the case suite (extra arguments go to pytest)", add_help=False)
    sub.add_parser("case", help="run cases by id and print their reports", add_help=False)
    sub.add_parser("gpu-check", help="list the GPUs, backends and optional libraries the GPU job uses")
    bench = sub.add_parser("bench", help="run benchmarks (formats, runtime); default: all")
    bench.add_argument("which", nargs="*")
    sub.add_parser("selftest", help="run the bug zoo and print how many mutants were caught",
                   add_help=False)
    sub.add_parser("golden", help="write (or --check) the golden corpus under golden/", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        return cmd_run(rest)
    if command == "case":
        return cmd_case(rest)
    if command == "gpu-check":
        return cmd_gpu_check(rest)
    if command == "selftest":
        return cmd_module("harness.selftest", rest)
    if command == "golden":
        return cmd_module("harness.golden", rest)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return cmd_bench(args.which)
    parser.error(f"unknown command {command!r}")
    return 2
