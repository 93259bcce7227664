"""Ctrl-C and SIGTERM held back while torch loads, and while the command line itself loads.

A KeyboardInterrupt raised inside torch's import lands in its pybind11 code, where it is not an
exception Python can handle: measured on CPU with torch 2.13, a Ctrl-C at 0.3-0.5 s into
`qgather run` was swallowed (the run went on and exited 0), aborted the process
(`terminate called after throwing an instance of 'pybind11::error_already_set'`, exit -6), or was
caught by qgather and still ended the process by SIGINT (CPython remembers a KeyboardInterrupt seen
in code run through `PyRun_String` and re-raises the signal at exit). Held back, the signal is
delivered the moment torch is loaded (about a second), and the command's own handling runs.
The command line's own start-up is held the same way from qgather.__main__'s first line until the
command raises what came (`release_start_up`), where it can write its reports.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

HELD_BACK = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held_back() -> Iterator[None]:
    """Record SIGINT and SIGTERM inside the block; raise each again, once, under its own handler after it."""
    received: list[int] = []
    saved = {signum: signal.signal(signum, lambda signum, _frame: received.append(signum)) for signum in HELD_BACK}
    try:
        yield
    finally:
        _give_back(saved, received)


def _give_back(saved: dict[int, Any], received: list[int], only_from: Any = None) -> None:
    """Each saved handler back in place (with `only_from`: only where that recording handler still is),
    then each recorded signal raised once under it."""
    for signum, handler in saved.items():
        if only_from is None or signal.getsignal(signum) is only_from:
            signal.signal(signum, handler)
    for signum in dict.fromkeys(received):
        signal.raise_signal(signum)


def load_torch() -> None:
    """Import torch (a no-op once loaded) with the interrupts held back (see the module's docstring)."""
    with signals_held_back():
        import torch  # noqa: F401


# The start-up's recorded signals (qgather.__main__), until the command raises them where it handles them.
# Process state, as the signal handlers themselves are; None once released, or where main() runs in-process.
_start_up: tuple[list[int], dict[int, Any], Any] | None = None


def hold_start_up(received: list[int], saved: dict[int, Any], record: Any) -> None:
    """Take over the start-up's recording handler `record`: `received` fills until release_start_up;
    `saved` holds the handlers it replaced."""
    global _start_up
    _start_up = (received, saved, record)


def release_start_up() -> None:
    """Give SIGINT and SIGTERM back their own handlers (where the recording one is still in place: a
    command's own, e.g. the pools' cleanup on SIGTERM, stays) and raise each signal recorded since the
    command line started, once, here: where the command handles it. A no-op after the first call."""
    global _start_up
    if _start_up is None:
        return
    received, saved, record = _start_up
    _start_up = None
    _give_back(saved, received, only_from=record)
