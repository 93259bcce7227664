"""Loading torch with Ctrl-C and SIGTERM held back until it has loaded.

A KeyboardInterrupt raised inside torch's import lands in its pybind11 code, where it is not an
exception Python can handle: measured on CPU with torch 2.13, a Ctrl-C at 0.3-0.5 s into
`qgather run` was swallowed (the run went on and exited 0), aborted the process
(`terminate called after throwing an instance of 'pybind11::error_already_set'`, exit -6), or was
caught by qgather and still ended the process by SIGINT (CPython remembers a KeyboardInterrupt seen
in code run through `PyRun_String` and re-raises the signal at exit). Held back, the signal is
delivered the moment torch is loaded (about a second), and the command's own handling runs.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

HELD_BACK = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held_back() -> Iterator[None]:
    """Record SIGINT and SIGTERM inside the block; raise each again, once, under its own handler after it."""
    received: list[int] = []
    saved = {signum: signal.signal(signum, lambda signum, _frame: received.append(signum)) for signum in HELD_BACK}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def load_torch() -> None:
    """Import torch (a no-op once loaded) with the interrupts held back (see the module's docstring)."""
    with signals_held_back():
        import torch  # noqa: F401
