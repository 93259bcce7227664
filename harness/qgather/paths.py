"""Where the case suite and the golden corpus live.

A source checkout keeps them at its top level: cases/ (thin modules over qgather.cases) and
golden/. An installed qgather (`pip install .`) has neither: it runs the packaged modules of
qgather/cases/ and reads the corpus that the build copies into qgather/golden_data/.
"""

from __future__ import annotations

import os
import re

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
PACKAGED_SUITE = "cases"
PACKAGED_GOLDEN = "golden_data"  # setup.py copies golden/ here; the name is repeated there
BASELINE_FILE = "known-issues.toml"  # the known-issues baseline a gate reads by default


def checkout_root() -> str | None:
    """The qgather source checkout this package is imported from, or None for an installed copy."""
    parent = os.path.dirname(os.path.dirname(PACKAGE_DIR))  # harness/qgather/ -> the checkout
    try:
        with open(os.path.join(parent, "pyproject.toml")) as fh:
            text = fh.read()
    except OSError:
        return None
    # Only qgather's own: an install into a directory that holds some other project is an install.
    return parent if re.search(r'^name\s*=\s*"qgather"\s*$', text, re.M) else None


def suite_dir() -> str:
    """The directory `qgather run` collects: cases/ of a checkout, else the packaged modules."""
    root = checkout_root()
    return os.path.join(root, "cases") if root else os.path.join(PACKAGE_DIR, PACKAGED_SUITE)


def golden_dir() -> str:
    """The stored golden corpus: golden/ of a checkout, else the copy inside the package."""
    root = checkout_root()
    return os.path.join(root, "golden") if root else os.path.join(PACKAGE_DIR, PACKAGED_GOLDEN)


def import_user_module(module_name: str) -> object:
    """A user's module (an adapter's, a format's): as installed (or on PYTHONPATH), else from the current
    directory, as pytest imports test modules from its rootdir. Every rank runs in the same directory and
    finds it the same way, so a `reproduce:` line runs as printed from where the run ran."""
    import importlib  # deferred: only a user's module is imported by name (README, "Layout")
    import sys

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        here = os.getcwd()
        if exc.name != top or here in sys.path or not _holds_module(here, top):
            raise
        sys.path.insert(0, here)
        importlib.invalidate_caches()
        return importlib.import_module(module_name)


def _holds_module(folder: str, name: str) -> bool:
    return os.path.isdir(os.path.join(folder, name)) or os.path.isfile(os.path.join(folder, f"{name}.py"))


def not_importable(module_name: str, exc: ModuleNotFoundError) -> str:
    """One line: which module is missing and how to make a user's module importable."""
    top = module_name.split(".")[0]
    if exc.name != top:  # the user's package is there; something it imports is not
        return f"cannot load it: importing {module_name!r} failed ({exc})"
    return (f"cannot load it: no module {top!r} here ({os.getcwd()}) or installed: run from the folder that "
            f"holds {top}/, put that folder on PYTHONPATH, or pip install the package")


def missing_user_module(module_name: str) -> str | None:
    """Why a user's module certainly cannot be imported (`not_importable`'s line), found without importing
    anything; None when it may be (then importing it says the rest)."""
    import importlib.util  # deferred, as import_user_module's

    top = module_name.split(".")[0]
    try:
        if importlib.util.find_spec(top) is not None or _holds_module(os.getcwd(), top):
            return None
    except (ImportError, ValueError):
        return None
    return not_importable(module_name, ModuleNotFoundError(name=top))
