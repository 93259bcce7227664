"""The `qgather` command line (also `python -m qgather`).

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
from typing import TYPE_CHECKING

from qgather.paths import checkout_root, suite_dir
from qgather.quiet import quiet_torchao

if TYPE_CHECKING:  # imported lazily at run time: the CLI starts without torch
    from qgather.suite.sweeps import SuiteSweep

BENCHES = {
    "formats": "qgather.tools.format_bench",
    "runtime": "qgather.runtime.bench",
    "gpu": "qgather.tools.case_bench",
    "suite": "qgather.tools.suite_bench",
}


def _run_pytest(args: Sequence[str]) -> int:
    import pytest

    return int(pytest.main(list(args)))


def _suite_pytest_args() -> list[str]:
    """The suite and the options every pytest run of it gets, in a checkout or an install."""
    suite = suite_dir()
    # The plugin's pytest11 entry point is off under PYTEST_DISABLE_PLUGIN_AUTOLOAD: name it by that
    # entry point's name (a module name would register it twice). pytest marks an installed plugin's
    # package for assertion rewriting, too late for qgather, which this command has imported.
    args = [suite, "-p", "qgather", "-p", "no:cacheprovider",
            "-W", "ignore:Module already imported so cannot be rewritten; qgather:pytest.PytestAssertRewriteWarning"]
    if checkout_root() is None:
        # The packaged suite is its own root: node ids relative to it, no conftest.py or ini file
        # of the directories above site-packages.
        args += ["--rootdir", suite]
    return args


def cmd_run(extra: list[str]) -> int:
    """The harness's main job: the case suite on whatever hardware is present."""
    if "-h" in extra or "--help" in extra:
        return _run_help()
    problem = _case_timeout_problem(extra) or _world_sizes_problem(extra)
    if problem:
        return _usage("run", problem)
    # One -q by default; a user's -q must not stack to -qq, which drops pytest's final line.
    quiet = [] if any(a in ("-q", "--quiet") or a.startswith("-qq") for a in extra) else ["-q"]
    # Reports by default (`--report-dir ''` turns them off): a CI run always has its summary and junit.xml.
    reports = [] if _option_value(extra, "--report-dir") is not None else ["--report-dir", "reports"]
    rc = _run_pytest([*_suite_pytest_args(), *quiet, "--qgather-summary", *reports, *extra])
    return 2 if rc == int(_pytest_usage_error()) else rc


def _option_value(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _case_timeout_problem(args: list[str]) -> str | None:
    """A bad --case-timeout, refused before pytest (and torch) load; the plugin checks it the same way."""
    from qgather.model.options import options_problem

    try:
        timeout = _option_value(args, "--case-timeout")
        return options_problem(None if timeout is None else float(timeout), "cpu", "gloo")
    except ValueError:
        return None  # pytest's option check reports it


def _world_sizes_problem(args: list[str]) -> str | None:
    """--world-sizes that no sweep of the suite has (checked here too: under xdist pytest cannot say so)."""
    try:
        sizes = set(_csv(_option_value(args, "--world-sizes"), int) or [])
    except ValueError:
        return None  # pytest's option check reports it
    if not sizes or any(sizes & set(sweep.world_sizes) for _m, sweep, _i in suite_sweeps()):
        return None
    return f"--world-sizes {','.join(map(str, sorted(sizes)))}: no case in the selected suite has that world size"


def _run_help() -> int:
    """qgather's own options first, then where pytest's are."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        _run_pytest([*_suite_pytest_args(), "--help"])
    lines = buffer.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("quantized all-gather harness")), None)
    print("usage: qgather run [qgather options] [pytest options]\n")
    print("Runs the case suite under pytest. qgather options:")
    if start is not None:
        for line in lines[start + 1:]:
            if line and not line.startswith(" "):
                break
            print(line)
    print("\nEvery other argument goes to pytest: see `python -m pytest --help` (e.g. -q, -x, -k EXPR, -n N).")
    return 0


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


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options that say where a case runs (shared by `case` and `repro`)."""
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--case-timeout", type=float, default=None)


def _run_options(command: str, args: argparse.Namespace):
    """The checked RunOptions, or None after printing the one-line reason to stderr."""
    from qgather.model.options import options_problem

    problem = options_problem(args.case_timeout, args.device, args.backend)
    if problem:
        _usage(command, problem)
        return None
    from qgather.engine.run import RunOptions  # after the check: a bad option is refused without importing torch

    # A hung case is re-run under TORCH_DISTRIBUTED_DEBUG=DETAIL; QGATHER_HANG_DETAIL=0 skips that.
    detail = command in ("case", "repro") and os.environ.get("QGATHER_HANG_DETAIL", "1") != "0"
    return RunOptions(args.backend, args.device, args.case_timeout, detail_on_hang=detail)


def cmd_case(argv: list[str]) -> int:
    """Run single cases by id and print their reports: the one-command reproduction."""
    parser = argparse.ArgumentParser(prog="qgather case", description=cmd_case.__doc__)
    parser.add_argument("case_ids", nargs="+", metavar="CASE_ID",
                        help="e.g. reference:nvfp4_2d:136x64:bf16:ws8:gather:s0")
    _add_run_options(parser)
    args = parser.parse_args(argv)
    options = _run_options("case", args)
    if options is None:
        return 2
    from qgather.engine.run import CaseInputError, run_case
    from qgather.impls import UnknownImplementationError
    from qgather.model.case import CaseSpec, CaseSpecError

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


def suite_sweeps() -> list[tuple[str, SuiteSweep, list[str] | None]]:
    """(module name, SWEEP, IMPLS override) of every case module, imported without pytest."""
    import importlib.util

    out = []
    directory = suite_dir()
    for filename in sorted(os.listdir(directory)):
        if not (filename.startswith("test_") and filename.endswith(".py")):
            continue
        name = f"qgather_suite_{filename[:-3]}"
        spec = importlib.util.spec_from_file_location(name, os.path.join(directory, filename))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # what dataclasses and pickling look a class's module up in
        spec.loader.exec_module(module)
        sweep = getattr(module, "SWEEP", None)
        if sweep is not None:
            out.append((filename[:-3], sweep, getattr(module, "IMPLS", None)))
    return out


def _csv(value: str | None, cast=str) -> list | None:
    if not value:
        return None
    return [cast(v.strip()) for v in value.split(",") if v.strip()]


def _impl_status(name: str) -> str:
    """'available' or why the implementation cannot run here (probed on its first format)."""
    import torch

    from qgather.impls import UnknownImplementationError, get_impl
    from qgather.model.case import CaseSpec

    try:
        impl = get_impl(name)
    except UnknownImplementationError as exc:
        return f"unavailable: {exc}"
    if not impl.formats:
        return "no formats"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in impl.devices:
        return f"unavailable here: runs on {', '.join(impl.devices)} only, and this host has no GPU"
    probe = CaseSpec(name, impl.formats[0], (64, 64), "bf16", 2, impl.scenarios[0], 0)
    reason = impl.skip_reason(probe, device)
    return f"unavailable here: {reason}" if reason else "available"


def cmd_list(argv: list[str]) -> int:
    """What the harness knows: implementations, formats, scenarios, mutants, or the case ids a selection runs."""
    parser = argparse.ArgumentParser(prog="qgather list", description=cmd_list.__doc__)
    parser.add_argument("what", nargs="?", default="all",
                        choices=("all", "impls", "formats", "scenarios", "mutants"))
    parser.add_argument("--cases", action="store_true", help="print the case ids the selection below would run")
    parser.add_argument("--impl", action="append", default=None)
    parser.add_argument("--formats", default=None)
    parser.add_argument("--world-sizes", default=None)
    parser.add_argument("--scenarios", default=None)
    parser.add_argument("--exhaustive", action="store_true", help="with --cases: the full product, not the default run")
    args = parser.parse_args(argv)
    if args.cases:
        return _list_cases(args)
    sections = ("impls", "formats", "scenarios", "mutants") if args.what == "all" else (args.what,)
    for section in sections:
        print(f"{section}:")
        for line in _LISTERS[section]():
            print(f"  {line}")
    return 0


def _list_impls() -> list[str]:
    from qgather.impls import available

    return [f"{name:<32} {_impl_status(name)}" for name in available() if not name.startswith("mutant:")]


def _list_formats() -> list[str]:
    from qgather.formats import FORMATS

    return [f"{name:<20} row block {fmt.row_block}" for name, fmt in FORMATS.items()]


def _list_scenarios() -> list[str]:
    from qgather.model.case import SCENARIOS

    return list(SCENARIOS)


def _list_mutants() -> list[str]:
    from qgather.impls.mutants import MUTANTS

    return [f"{m.name:<36} bug class {m.bug_class}  expected {m.expected.value}" for m in MUTANTS]


_LISTERS = {"impls": _list_impls, "formats": _list_formats, "scenarios": _list_scenarios, "mutants": _list_mutants}


def _list_cases(args: argparse.Namespace) -> int:
    from qgather.formats import FORMATS
    from qgather.model.case import SCENARIOS

    impls = [n for item in (args.impl or ["reference"]) for n in _csv(item)]
    formats, scenarios = _csv(args.formats), _csv(args.scenarios)
    for fmt in formats or []:
        if fmt not in FORMATS:
            return _usage("list", f"--formats: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    for scenario in scenarios or []:
        if scenario not in SCENARIOS:
            return _usage("list", f"--scenarios: unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    try:
        sizes = _csv(args.world_sizes, int)
    except ValueError:
        return _usage("list", "--world-sizes takes comma-separated integers, e.g. 2,4,8")
    count = 0
    for _module, sweep, fixed in suite_sweeps():
        for case in sweep.cases(fixed or impls, formats=formats, world_sizes=sizes, scenarios=scenarios,
                                exhaustive=args.exhaustive):
            print(case.id)
            count += 1
    if count == 0:
        return _usage("list", "the selection has no cases")
    return 0


def _usage(command: str, message: str) -> int:
    print(f"qgather {command}: {message}", file=sys.stderr)
    return 2


def cmd_repro(argv: list[str]) -> int:
    """Run one case and print its full report, the environment, and the command that reproduces it."""
    parser = argparse.ArgumentParser(prog="qgather repro", description=cmd_repro.__doc__)
    parser.add_argument("case_id", metavar="CASE_ID")
    _add_run_options(parser)
    args = parser.parse_args(argv)
    options = _run_options("repro", args)
    if options is None:
        return 2
    from qgather.engine.run import CaseInputError, run_case
    from qgather.impls import UnknownImplementationError
    from qgather.model.case import CaseSpec, CaseSpecError

    try:
        spec = CaseSpec.parse(args.case_id)
        report = run_case(spec, options)
    except (CaseSpecError, CaseInputError, UnknownImplementationError) as exc:
        return _usage("repro", str(exc))
    finally:
        _shutdown_pools()
    print(report.render())
    print()
    for line in environment_lines(options, spec.world_size):
        print(line)
    print(f"reproduce: {repro_command(spec.id, args)}")
    return 0 if report.passed else 1


def environment_lines(options, world_size: int) -> list[str]:
    """python, torch, TransformerEngine, torchao versions, the GPU (or none) and the backend used."""
    import platform

    import torch

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
    from importlib.metadata import PackageNotFoundError, version

    for dist in (module, module.replace("_", "-")):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def repro_command(case_id: str, args: argparse.Namespace) -> str:
    """A command that reruns the case from a fresh shell in any directory."""
    import shlex

    paths = [_import_root("qgather")]
    from qgather.model.case import CaseSpec

    module_name, sep, _ = CaseSpec.parse(case_id).impl.partition(":")
    if sep and module_name not in ("mutant", "torchao", "te"):
        paths.append(_import_root(module_name))
    paths = list(dict.fromkeys(p for p in paths if p))
    words = [sys.executable, "-m", "qgather", "case", case_id]
    if args.backend != "auto":
        words += ["--backend", args.backend]
    if args.device != "auto":
        words += ["--device", args.device]
    if args.case_timeout is not None:
        words += ["--case-timeout", repr(args.case_timeout)]
    command = " ".join(shlex.quote(w) for w in words)
    if paths:
        command = f"PYTHONPATH={shlex.quote(os.pathsep.join(paths))} {command}"
    return command


def _import_root(module_name: str) -> str | None:
    """The sys.path directory `module_name` is imported from, when a fresh shell could not import it."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    origin = os.path.abspath(getattr(module, "__file__", "") or "")
    probe = f"import importlib.util; s = importlib.util.find_spec({module_name!r}); print(s and s.origin)"
    try:
        found = subprocess.run([sys.executable, "-c", probe], env=env, cwd="/", capture_output=True, text=True,
                               timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        found = ""
    if found and os.path.realpath(found) == os.path.realpath(origin):
        return None  # a fresh shell imports this very module
    depth = module_name.count(".") + (2 if os.path.basename(origin) == "__init__.py" else 1)
    for _ in range(depth):
        origin = os.path.dirname(origin)
    return origin


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
    if "qgather.runtime.registry" not in sys.modules:
        return  # no pool was ever made (e.g. a bad option refused early): nothing to import torch for
    try:
        from qgather.runtime import shutdown_pools
    except ImportError:
        return
    shutdown_pools()


_POOL_COMMANDS = {"run": lambda rest: cmd_run(rest), "case": lambda rest: cmd_case(rest),
                  "repro": lambda rest: cmd_repro(rest)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qgather",
        description="Correctness harness for quantized weight all-gather under PyTorch FSDP2.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the case suite (extra arguments go to pytest)", add_help=False)
    sub.add_parser("case", help="run cases by id and print their reports", add_help=False)
    sub.add_parser("list", help="list implementations, formats, scenarios, mutants; --cases: a selection's case ids",
                   add_help=False)
    sub.add_parser("repro", help="run one case; print its report, the environment and the command to rerun it",
                   add_help=False)
    sub.add_parser("gpu-check", help="list the GPUs, backends and optional libraries the GPU job uses")
    bench = sub.add_parser("bench", help="run benchmarks (formats, runtime, gpu, suite: cases/s); default: all")
    bench.add_argument("which", nargs="*")
    sub.add_parser("selftest", help="run the bug zoo and print how many mutants were caught",
                   add_help=False)
    sub.add_parser("golden", help="write (or --check) the golden corpus under golden/", add_help=False)
    sub.add_parser("baseline", help="update the known-issues baseline from a run's verdicts.json", add_help=False)
    sub.add_parser("coverage", help="print the coverage matrix (format x buffer x regime x scenario x configuration) "
                   "of a selection as Markdown", add_help=False)
    sub.add_parser("sweep", help="explore shapes x world sizes of one impl and format; shrink each failure group",
                   add_help=False)
    return parser


def _with_cleanup_on_signals(command: str, run, rest: list[str]) -> int:
    """SIGTERM and Ctrl-C unwind through the pools' own cleanup (their `finally`s stop every rank
    and helper), then exit non-zero: 128 + the signal number, as a shell reports it.

    SIGTERM is raised as KeyboardInterrupt, which an in-process pytest session (`qgather run`)
    treats as the end of the session, where a SystemExit would only fail the running test.
    """
    import signal

    received: list[int] = []

    def terminate(signum, _frame):
        received.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        rc = run(rest)
    except KeyboardInterrupt:
        print(f"qgather {command}: interrupted", file=sys.stderr)
        rc = 128 + (received[0] if received else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _shutdown_pools()
    if received and rc == 0:
        rc = 128 + received[0]
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`qgather list --cases | head`): stop quietly, as `yes | head` does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_torchao()
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in _POOL_COMMANDS:
        return _with_cleanup_on_signals(command, _POOL_COMMANDS[command], rest)
    if command == "list":
        return cmd_list(rest)
    if command == "gpu-check":
        return cmd_gpu_check(rest)
    if command == "selftest":
        return cmd_module("qgather.tools.selftest", rest)
    if command == "golden":
        return cmd_module("qgather.tools.golden", rest)
    if command == "baseline":
        return cmd_module("qgather.pytest_plugin.baseline", rest)
    if command == "sweep":
        return cmd_module("qgather.tools.explore", rest)
    if command == "coverage":
        return cmd_module("qgather.suite.coverage", rest)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return cmd_bench(args.which)
    parser.error(f"unknown command {command!r}")
    return 2
