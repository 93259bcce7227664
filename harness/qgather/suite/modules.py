"""The case suite's modules, imported without pytest: each one's SWEEP and IMPLS, for the commands
that list or measure a selection (`qgather list --cases`, `qgather coverage`, `qgather run`'s checks)."""

from __future__ import annotations

import importlib.util
import os
import sys

from qgather.paths import suite_dir
from qgather.suite.sweeps import SuiteSweep


def suite_sweeps() -> list[tuple[str, SuiteSweep, list[str] | None]]:
    """(module name, SWEEP, IMPLS override) of every case module of the suite `qgather run` collects."""
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
