"""The one command that reruns a case: `qgather case <id>` with the run options that differ from
the defaults, as typed in the shell README's set-up leaves the user in (the venv activated).
Every report (the failure text, the terminal summary, JSON, Markdown, JUnit) and
`qgather repro` print what this module builds."""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys


def repro_command(case_id: str, backend: str = "auto", device: str = "auto", case_timeout: float | None = None,
                  *, standalone: bool = False, adapter_module: str | None = None) -> str:
    """The command line that reruns `case_id` under the same options.

    Args:
        case_id: the case's id (`impl:format:MxK:dtype:wsN:scenario:sSEED[:CONFIG]`).
        backend, device, case_timeout: the run's options; defaults are left out.
        standalone: a command that works from a fresh shell in any directory with qgather's
            environment active (README's set-up: `source .venv/bin/activate`), with PYTHONPATH for
            modules that shell could not import (a user's adapter).
        adapter_module: the module of the case's user adapter (`package.module:object`), as the
            implementation registry says (qgather.impls.adapter_module); None for a built-in.

    Example:
        >>> repro_command("reference:fp8_tensor:128x64:bf16:ws2:gather:s0", device="cpu")
        'qgather case reference:fp8_tensor:128x64:bf16:ws2:gather:s0 --device cpu'
    """
    words = ["qgather", "case", case_id]  # every printed repro is the plain command (README's shell has it)
    if device != "auto":
        words += ["--device", device]
    if backend != "auto":
        words += ["--backend", backend]
    if case_timeout is not None:
        words += ["--case-timeout", repr(case_timeout)]
    command = shlex.join(words)
    paths = _missing_import_roots(["qgather", *filter(None, [adapter_module])]) if standalone else []
    return f"PYTHONPATH={shlex.quote(os.pathsep.join(paths))} {command}" if paths else command


def _missing_import_roots(modules: list[str]) -> list[str]:
    """sys.path entries a fresh shell lacks for `modules` (qgather and the case's own adapter module)."""
    return list(dict.fromkeys(p for p in map(_import_root, modules) if p))


def _import_root(module_name: str) -> str | None:
    """The sys.path directory `module_name` is imported from, when a fresh shell could not import it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except ImportError:
        return None
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
