"""What the command groups share: the shared options added to argparse with the same parsers the
pytest plugin uses, the one-line usage error, the checked RunOptions, and the rank pools' cleanup
(on return and on SIGTERM or Ctrl-C).

Nothing here imports torch: `qgather --help` and an option refused by its syntax start without it.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from qgather.cli.interrupts import release_start_up
from qgather.errors import QgatherError
from qgather.suite.options import RUN_OPTIONS, SELECTION_OPTIONS, OptionError, OptionSpec, gpu_problem, joined_impls

if TYPE_CHECKING:  # imported when a case runs: the CLI starts without torch
    from qgather.engine.run import RunOptions


USAGE_ERROR = 4  # pytest.ExitCode.USAGE_ERROR: bad input, in every command (README's "Exit codes")
INTERRUPTED = 2  # pytest.ExitCode.INTERRUPTED: Ctrl-C or SIGTERM during a run


class OptionRefused(QgatherError):
    """A bad option value met while parsing. Not a ValueError, which argparse would turn into its
    two-line usage message: it reaches `qgather.cli.main`, which prints one line and exits 4."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _for_cli(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except OptionError as exc:
            raise OptionRefused(str(exc)) from None

    parsed.__name__ = parse.__name__
    return parsed


def refusing_in_one_line(command: str) -> Callable[[Callable[[Sequence[str]], int]], Callable[[Sequence[str]], int]]:
    """Decorate a command's main: a bad option value (OptionRefused) is `usage(command, ...)`, exit 4."""

    def decorate(main: Callable[[Sequence[str]], int]) -> Callable[[Sequence[str]], int]:
        @functools.wraps(main)
        def checked(argv: Sequence[str]) -> int:
            try:
                return main(argv)
            except OptionRefused as exc:
                return usage(command, exc.message)

        return checked

    return decorate


def add_options(parser: argparse.ArgumentParser, specs: Iterable[OptionSpec]) -> None:
    """Add shared options (qgather.suite.options) as the plugin declares them, with the same parsers."""
    for spec in specs:
        parser.add_argument(spec.flag, **spec.keywords(_for_cli))


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--backend, --device, --case-timeout: where a case runs (`case`, `repro`, `sweep`)."""
    add_options(parser, RUN_OPTIONS)


def add_selection_options(parser: argparse.ArgumentParser) -> None:
    """--impl, --formats, --world-sizes, --scenarios, --exhaustive: which cases (`list`, `coverage`, `run`)."""
    add_options(parser, SELECTION_OPTIONS)


def selection_problem(args: argparse.Namespace, cases: Sequence[object]) -> str | None:
    """Why the selection options (--impl, --formats, --world-sizes, --scenarios) do not say what runs
    (None: they do): a listed value no case has, or no case at all."""
    from qgather.suite.selection import declared, device_type, unmatched, why_empty  # deferred: imports the registries

    named = list(args.impl and [n for value in args.impl for n in value] or ())
    device = device_type(getattr(args, "device", "auto"))
    if cases:
        return unmatched(cases, args.formats, args.world_sizes, args.scenarios, named, device)
    known = f" ({declared(named)})" if named else ""
    return why_empty(named, device) or f"{selection_text(args)}: no case of the suite matches this selection{known}"


def selection_text(args: argparse.Namespace) -> str:
    """The selection options as given, e.g. `--formats fp8_tensor --scenarios model`."""
    parts = [f"--impl {','.join(joined_impls(args.impl))}"] if args.impl else []
    for flag, value in (("--formats", args.formats), ("--world-sizes", args.world_sizes),
                        ("--scenarios", args.scenarios)):
        if value:
            parts.append(f"{flag} {','.join(map(str, value))}")
    return " ".join(parts) or "the default selection"


def usage(command: str, message: str) -> int:
    """Print `qgather <command>: <message>` to stderr, one line; the usage-error exit status."""
    print(f"qgather {command}: {message}", file=sys.stderr)
    return USAGE_ERROR


def run_options(command: str, args: argparse.Namespace) -> RunOptions | None:
    """The checked RunOptions of parsed run options, or None after printing the one-line reason."""
    problem = gpu_problem(args.device, args.backend)
    if problem:
        usage(command, problem)
        return None
    from qgather.engine.run import RunOptions  # after the check: a bad option is refused without torch

    # A hung case is re-run under TORCH_DISTRIBUTED_DEBUG=DETAIL; QGATHER_HANG_DETAIL=0 skips that.
    detail = command in ("case", "repro") and os.environ.get("QGATHER_HANG_DETAIL", "1") != "0"
    return RunOptions(args.backend, args.device, args.case_timeout, detail_on_hang=detail)


def shutdown_pools() -> None:
    """Stop every rank pool this process started (none: nothing is imported)."""
    if "qgather.runtime.registry" not in sys.modules:
        return  # no pool was ever made (e.g. a bad option refused early): nothing to import torch for
    from qgather.runtime import shutdown_pools as shutdown  # loaded already (see above)

    shutdown()


def with_cleanup_on_signals(command: str, run: Callable[[Sequence[str]], int], rest: Sequence[str],
                            release: bool = True) -> int:
    """SIGTERM and Ctrl-C unwind through the pools' own cleanup (their `finally`s stop every rank
    and helper), then exit 2 (pytest's "interrupted"; the pytest session of `qgather run` has
    printed how many cases ran).

    SIGTERM is raised as KeyboardInterrupt, which an in-process pytest session (`qgather run`)
    treats as the end of the session, where a SystemExit would only fail the running test. With `release`,
    an interrupt held since the command line started (qgather.cli.interrupts) is raised here first.
    """
    received: list[int] = []

    def terminate(signum: int, _frame: object) -> None:
        received.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        if release:
            release_start_up()
        rc = run(rest)
    except KeyboardInterrupt:
        print(f"qgather {command}: interrupted", file=sys.stderr)
        rc = INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        _shutdown_uninterrupted(received)
    if received and rc == 0:
        rc = INTERRUPTED
    return rc


def _shutdown_uninterrupted(received: list[int]) -> None:
    """Stop the pools; a Ctrl-C or SIGTERM that arrives meanwhile (after pytest's last line) is recorded
    in `received`, not raised: the cleanup it asks for is already running, and must not be cut short
    (the process would die by the signal, its exit status lost)."""
    record = lambda signum, _frame: received.append(signum)  # noqa: E731
    saved = {signum: signal.signal(signum, record) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        shutdown_pools()
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
