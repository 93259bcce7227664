"""The names the command line checks before torch is imported: the built-in formats, scenarios and
implementations, and the names other packages add through entry points. An unknown name is refused
in one line at once (a bad option costs no torch import); a known one is loaded by its registry
(qgather.formats.FORMATS, qgather.impls), which tests/test_bad_input.py checks against these names.

    unknown_names(("fp8_tensor", "fp7"), FORMAT_NAMES, "qgather.formats")  -> ["fp7"]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points

FORMAT_NAMES = ("fp8_tensor", "fp8_tensor_e5m2", "fp8_block", "fp8_block_1x128", "mxfp8", "nvfp4_1d", "nvfp4_2d")
SCENARIOS = ("gather", "steps", "reshard", "hooks", "virtual", "model", "layers", "block")
#: the built-in adapters other than the bug zoo's `mutant:<bug>` (qgather.impls.BUILTIN_MODULES)
BUILTIN_IMPLS = ("reference", "te", "te:delayed", "te:prequantized", "torchao", "torchao:precompute")
MUTANT_PREFIX = "mutant:"
#: the families whose names hold a colon: `mutant:x` is a built-in name, never a module to import
BUILTIN_FAMILIES = ("mutant", "torchao", "te")


def plugin_names(group: str) -> tuple[str, ...]:
    """The names other packages register in an entry-point group (read from metadata, not loaded)."""
    return tuple(sorted(ep.name for ep in entry_points(group=group)))


def unknown_names(names: Iterable[str], known: Sequence[str], group: str) -> list[str]:
    """The names that are neither built in (`known`) nor registered in the entry-point `group`."""
    rest = [name for name in names if name not in known]
    return [name for name in rest if name not in plugin_names(group)] if rest else []


def is_unknown_impl(name: str) -> bool:
    """Whether `name` certainly names no implementation: not built in, no mutant, no entry point and
    not package.module:object. (A mutant's or a module's name is checked by loading it.)"""
    family = name.partition(":")[0]
    if name in BUILTIN_IMPLS or name.startswith(MUTANT_PREFIX) or (":" in name and family not in BUILTIN_FAMILIES):
        return False
    return name not in plugin_names("qgather.impls")


def external_module(name: str) -> str | None:
    """The module a user's `package.module:object` implementation name imports (None: a built-in, mutant or
    entry-point name), read from the name alone."""
    family = name.partition(":")[0]
    if ":" not in name or name in BUILTIN_IMPLS or family in BUILTIN_FAMILIES or name in plugin_names("qgather.impls"):
        return None
    return family


def impl_choices(names: Iterable[str]) -> str:
    """The implementations to choose from, short: the bug zoo as one entry (`qgather list mutants`)."""
    shown = sorted(n for n in names if not n.startswith(MUTANT_PREFIX))
    return ", ".join([*shown, f"{MUTANT_PREFIX}<bug> (qgather list mutants)", "or package.module:object"])
