"""The run and selection options, each declared once and parsed once: the `type=` parsers and the
declarations that the pytest plugin (qgather.pytest_plugin.options) and the command line
(qgather.cli) both add to their parsers, so that a value is checked the same way everywhere.

A parser returns plain values (str, int, float, tuples of them: xdist sends the parsed options to its
workers) and raises `OptionError`, one line naming the option. The registries (formats,
implementations, scenarios) import torch, so their parsers import them when called: `qgather --help`
and an option refused by its syntax alone start no torch.

    parse_world_sizes("2,4")  -> (2, 4)
    parse_formats("fp7")      -> OptionError: --formats: unknown format 'fp7'; known: fp8_tensor, ...
"""

from __future__ import annotations

import glob
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qgather.errors import UsageError
from qgather.model.names import (
    BUILTIN_IMPLS,
    FORMAT_NAMES,
    SCENARIOS,
    external_module,
    impl_choices,
    is_unknown_impl,
    plugin_names,
    unknown_names,
)
from qgather.paths import missing_user_module

DEFAULT_IMPLS = ("reference",)
AUTO = "auto"
BACKENDS = (AUTO, "gloo", "nccl")
DEVICES = (AUTO, "cpu", "cuda")


class OptionError(UsageError):
    """An option value that cannot be used: one line naming the option and what it takes."""


def split_names(text: str) -> tuple[str, ...]:
    """A comma-separated list, blanks dropped: "a, b,,c" -> ("a", "b", "c")."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_impls(text: str) -> tuple[str, ...]:
    """--impl: implementation names, each one the registry can load (an adapter is imported here)."""
    names = split_names(text)
    if not names:
        raise OptionError("--impl: no implementation named")
    for name in names:  # a name nothing could load is refused before torch is imported
        refuse_unknown_impl(name)
    # deferred: the registry imports torch and the adapters, which the CLI's --help must not
    from qgather.impls import UnknownImplementationError, get_impl

    for name in names:
        try:
            get_impl(name)
        except UnknownImplementationError as exc:
            raise OptionError(f"--impl: {exc}") from None
    return names


def refuse_unknown_impl(name: str, option: str = "--impl") -> None:
    """OptionError when `name` certainly names no implementation (checked without importing torch;
    whether a name that may exist loads is the registry's check)."""
    if is_unknown_impl(name):
        known = impl_choices((*BUILTIN_IMPLS, *plugin_names("qgather.impls")))
        raise OptionError(f"{option}: unknown implementation {name!r}; available: {known}")
    module = external_module(name)
    missing = module and missing_user_module(module)
    if missing:
        raise OptionError(f"{option}: implementation {name!r}: {missing}")


def refuse_unknown_formats(names: Sequence[str], option: str = "--formats") -> None:
    """OptionError naming the first of `names` that no built-in or plugin format has (no torch); a
    `package.module:Class` is a format of the user's own, checked by loading it (a module nothing here
    could import is refused now, as an adapter's is)."""
    for name in names:
        module = name.partition(":")[0] if ":" in name else ""
        missing = module and missing_user_module(module)
        if missing:
            raise OptionError(f"{option} {name!r}: {missing}")
    names = [name for name in names if ":" not in name]
    unknown = unknown_names(names, FORMAT_NAMES, "qgather.formats")
    registry = sys.modules.get("qgather.formats.registry")  # an adapter loaded already may have added some
    unknown = [name for name in unknown if registry is None or name not in registry.FORMATS]
    if unknown:
        known = (*FORMAT_NAMES, *plugin_names("qgather.formats"), *(registry.user_formats() if registry else ()))
        raise OptionError(f"{option}: unknown format {unknown[0]!r}; known: {', '.join(dict.fromkeys(known))} "
                          "(a format of your own: package.module:Class, or give first the --impl that lists it)")


def parse_formats(text: str) -> tuple[str, ...]:
    """--formats: format names the registry knows (entry-point formats included), or formats of the
    user's own as `package.module:Class` (loaded and registered here; the names they register)."""
    names = split_names(text)
    refuse_unknown_formats(names)  # before torch is imported
    if all(name in FORMAT_NAMES for name in names):
        return names  # built-in names: known without importing the formats (torch)
    from qgather.formats import FORMATS, FormatLoadError, load_format  # deferred: the formats import torch

    try:
        names = tuple(load_format(name, f"--formats {name!r}") if ":" in name else name for name in names)
    except FormatLoadError as exc:
        raise OptionError(str(exc)) from None
    return _known_names("--formats", "format", ",".join(names), FORMATS)


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """--world-sizes: positive integers."""
    try:
        sizes = tuple(int(part) for part in split_names(text))
    except ValueError:
        raise OptionError("--world-sizes takes comma-separated integers, e.g. 2,4,8") from None
    if any(size < 1 for size in sizes):
        raise OptionError(f"--world-sizes: a world size must be >= 1, got {list(sizes)}")
    return sizes


def parse_scenarios(text: str) -> tuple[str, ...]:
    """--scenarios: scenario names."""
    return _known_names("--scenarios", "scenario", text, SCENARIOS)


def _known_names(option: str, what: str, text: str, known) -> tuple[str, ...]:
    names = split_names(text)
    for name in names:
        if name not in known:
            raise OptionError(f"{option}: unknown {what} {name!r}; known: {', '.join(known)}")
    return names


def parse_case_timeout(text: str) -> float:
    """--case-timeout: a finite number of seconds > 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise OptionError(f"--case-timeout must be a finite number of seconds > 0, got {text}")
    return seconds


def joined_impls(values: Iterable[Sequence[str]] | None) -> tuple[str, ...]:
    """The --impl values of a repeatable option (each already parsed), in order, or the default."""
    names = tuple(name for value in values or () for name in value)
    return names or DEFAULT_IMPLS


def gpu_problem(device: str, backend: str) -> str | None:
    """Why --device cuda or --backend nccl cannot work on this host (None: fine). Where no GPU device is
    visible at all it is said without importing torch (a refusal within a second), else torch is asked."""
    if device != "cuda" and backend != "nccl":
        return None
    asked = "--device cuda" if device == "cuda" else "--backend nccl"
    hidden = _no_gpu_visible()
    if hidden:
        return f"{asked}: no CUDA GPU on this host ({hidden})"
    import torch  # deferred: asked only when a GPU is asked for and may be there

    if torch.cuda.is_available():
        return None
    return f"{asked}: no CUDA GPU on this host (torch.cuda.is_available() is False)"


#: device nodes of a GPU torch.cuda may use: NVIDIA's, ROCm's (torch.cuda on HIP), WSL's
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def _no_gpu_visible() -> str:
    """Why this process certainly sees no GPU, read without torch ("" when it may see one)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES):
        return "no GPU device in /dev"
    return ""


def output_problem(flag: str, path: str, directory: bool = False) -> str | None:
    """Why qgather cannot write the output `path` of option `flag` (None: it can), checked before the
    first case runs. The directory (of a file: its parent) is created, as the run would create it."""
    folder = path if directory else os.path.dirname(os.path.abspath(path))
    if not directory and os.path.isdir(path):
        return f"{flag} {path}: is a directory, not a file"
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".qgather-probe-"):
            pass
    except OSError as exc:
        return f"{flag} {path}: cannot write there ({exc.strerror or type(exc).__name__})"
    return None


# ------------------------------------------------------------------ declarations
@dataclass(frozen=True)
class OptionSpec:
    """One option as both parsers declare it (argparse's keywords; pytest's addoption takes the same)."""

    flag: str
    help: str
    parse: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    action: str | None = None
    metavar: str | None = None

    def keywords(self, wrap: Callable[[Callable[[str], Any]], Callable[[str], Any]]) -> dict[str, Any]:
        """The keywords of `add_argument` / `addoption`; `wrap` turns an OptionError into what that
        parser reports as one line."""
        out: dict[str, Any] = {"help": self.help, "default": self.default}
        for name in ("choices", "action", "metavar"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.parse is not None:
            out["type"] = wrap(self.parse)
        return out


SELECTION_OPTIONS = (
    OptionSpec("--impl", "implementation(s) under test: reference, mutant:<bug>, torchao, te, or package.module:object "
               "(repeat or comma-separate; default: reference)", parse_impls, action="append"),
    OptionSpec("--formats", "comma-separated formats (default: all)", parse_formats),
    OptionSpec("--world-sizes", "comma-separated world sizes (default: the sweep's)", parse_world_sizes),
    OptionSpec("--scenarios", "comma-separated scenarios: gather, steps, reshard, hooks, virtual, model",
               parse_scenarios),
    OptionSpec("--exhaustive", "every sweep's full product (dtype x seed x configuration) instead of the pairwise "
               "covering design; the extra cases are marked slow", default=False, action="store_true"),
)

RUN_OPTIONS = (
    OptionSpec("--backend", "process-group backend (auto: nccl when each rank can have its own GPU)", default=AUTO,
               choices=BACKENDS),
    OptionSpec("--device", "where the ranks' tensors live (auto: cuda when available)", default=AUTO,
               choices=DEVICES),
    OptionSpec("--case-timeout", "seconds before a case is declared HANG (default: per backend)", parse_case_timeout),
)
