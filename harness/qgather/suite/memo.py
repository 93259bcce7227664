"""The suite's generated cases kept on disk between processes, so that `qgather list --cases` and the
selection check before `qgather run` (the callers that ask: `suite_cases(..., memo=True)`) do not
recompute the covering designs (about 2 s on 2 cores) every time. A memo, not a second source: an
entry is the very list a sweep's `cases(...)` returned, stored under a key made of everything that
list is computed from:

  - the bytes of every module of the qgather package and of the suite's directory (cases/ of a
    checkout), so that any edit, of a sweep or of the rules it applies, is a new key;
  - the Python and torch versions (FSDP2's rules depend on torch's: qgather.model.fsdp_rules);
  - the sweep's module and the call's arguments.

The same file keeps other pure functions of the source that a run computes each time (`Memo.value`):
the configuration designs' achievable and impossible pairs, which every run's coverage.md reports
(about 3 s of the controller after the last case).

Format plugins (entry points of `qgather.formats`, and formats an adapter or `--formats` loads) add code
outside the package that sweeps read through FORMATS, so with any of them the memo is not used. One file
per key's source part under `$QGATHER_CACHE_DIR`, else `$XDG_CACHE_HOME/qgather`, else
`~/.cache/qgather`; `QGATHER_CACHE_DIR=off` turns the memo off. A file that cannot be read or written is
ignored: the cases are computed instead.

    memo = Memo()
    generated = memo.cases("test_alignment", sweep, impls, formats=..., world_sizes=..., scenarios=...)
    memo.flush()
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from qgather.formats import user_formats
from qgather.model.case import CaseSpec
from qgather.paths import PACKAGE_DIR, suite_dir

CACHE_ENV = "QGATHER_CACHE_DIR"
OFF = "off"
_PREFIX = "cases-"
KEEP = 8  # memo files kept, newest first


class Memo:
    """One pass over the sweeps: cases served from the memo file or computed, the file written once
    at the end (`flush`), with whatever this pass computed."""

    def __init__(self) -> None:
        # a format of the user's own (an adapter's, --formats') is code outside the digest: no memo then
        self.path = None if user_formats() else _memo_path()
        self.entries = dict(_entries(self.path)) if self.path else {}
        self.added = False

    def cases(self, module: str, sweep: Any, impls: Sequence[str], **selection: Any) -> list[CaseSpec]:
        """`sweep.cases(impls, **selection)`, from the memo when this source has computed it before."""
        key = repr((module, tuple(impls), sorted((k, _frozen(v)) for k, v in selection.items())))
        if key in self.entries:
            return list(self.entries[key])
        generated = list(sweep.cases(list(impls), **selection))
        if self.path:
            self.entries[key], self.added = generated, True
        return generated

    def value(self, key: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, from the memo when this source has computed it under `key` before (`key` must
        name everything the value depends on beside the source: a design by its repr, not its name)."""
        key = f"value {key}"
        if key in self.entries:
            return self.entries[key]
        found = compute()
        if self.path:
            self.entries[key], self.added = found, True
        return found

    def flush(self) -> None:
        """Write what this pass computed (nothing when it computed nothing)."""
        if self.added:
            _store(self.path, self.entries)
            _entries.cache_clear()  # this process reads the new file next
            self.added = False


def cases(module: str, sweep: Any, impls: Sequence[str], **selection: Any) -> list[CaseSpec]:
    """One sweep's cases through a Memo of its own, written at once."""
    memo = Memo()
    found = memo.cases(module, sweep, impls, **selection)
    memo.flush()
    return found


def cache_dir() -> str | None:
    """Where the memo lives, or None when QGATHER_CACHE_DIR=off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen == OFF:
        return None
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qgather")


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


@cache
def _memo_path() -> str | None:
    """This source's memo file (computed once per process), or None when the memo is not used."""
    where = cache_dir()
    if where is None or any(True for _ in entry_points(group="qgather.formats")):
        return None
    return os.path.join(where, f"{_PREFIX}{source_digest()}.pickle")


def source_digest() -> str:
    """A digest of every module the generated cases depend on, and of the Python and torch versions."""
    import torch  # deferred: the version only; the suite imports torch anyway

    digest = hashlib.sha256(f"{sys.version_info[:2]} {torch.__version__}".encode())
    for root in dict.fromkeys((PACKAGE_DIR, suite_dir())):
        for path in sorted(_modules_under(root)):
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest()[:32]


def _modules_under(root: str) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return found


@cache
def _entries(path: str) -> dict[str, Any]:
    """The memo file's entries, read once per process until this process writes it (Memo copies them)."""
    try:
        with open(path, "rb") as fh:
            entries = pickle.load(fh)
    except Exception:  # noqa: BLE001 - absent, half-written by an older qgather, unreadable: compute instead
        return {}
    return entries if isinstance(entries, dict) else {}


def _store(path: str, entries: dict[str, Any]) -> None:
    """Write atomically (a concurrent reader sees the old file or the new one), then keep only the
    KEEP newest files: each edit of the package makes a new one (several checkouts share the folder)."""
    folder = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(entries, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        tmp = None
        memos = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(_PREFIX)]
        for old in sorted(memos, key=os.path.getmtime, reverse=True)[KEEP:]:
            os.remove(old)
    except OSError:
        return  # a read-only home, a full disk, a file another process removed: the memo is only a shortcut
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
