"""The case suite's modules, imported without pytest: each one's SWEEP and IMPLS, for the commands
that list or measure a selection (`qgather list --cases`, `qgather coverage`, `qgather run`'s checks)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from qgather.paths import suite_dir
from qgather.suite.sweeps import SuiteSweep


def suite_sweeps() -> list[tuple[str, SuiteSweep, list[str] | None]]:
    """(module name, SWEEP, IMPLS override) of every case module of the suite `qgather run` collects."""
    return [(name, module.SWEEP, getattr(module, "IMPLS", None)) for name, module in suite_modules()
            if getattr(module, "SWEEP", None) is not None]


def suite_companions() -> list[tuple[str, SuiteSweep, tuple[str, ...]]]:
    """(module name, sweep, its implementations) of every module's COMPANIONS: cases the default run (no
    --impl) runs beside the SWEEP's, with implementations of their own (torchao's sets beside the reference)."""
    return [(name, *module.COMPANIONS) for name, module in suite_modules() if getattr(module, "COMPANIONS", None)]


def suite_modules() -> list[tuple[str, ModuleType]]:
    """(name, module) of every case module of the suite, imported (once per process) without pytest."""
    out = []
    directory = suite_dir()
    for filename in sorted(os.listdir(directory)):
        if not (filename.startswith("test_") and filename.endswith(".py")):
            continue
        name = f"qgather_suite_{filename[:-3]}"
        path = os.path.join(directory, filename)
        module = sys.modules.get(name)
        if module is None or getattr(module, "__file__", None) != path:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # what dataclasses and pickling look a class's module up in
            spec.loader.exec_module(module)
        out.append((filename[:-3], module))
    return out
