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
