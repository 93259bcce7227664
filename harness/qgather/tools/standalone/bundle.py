"""qgather's reference subclass as source a standalone script carries (`sources`): the modules the
parameter class needs, in the order they must run, each rewritten from `qgather.` to the private
package name `qref.` so that the script imports no qgather; a zoo mutant's module(s) after them.

What is not copied is generated in a few lines, named as such: the packages' own modules, the
formats' registry (a table of the built-in formats), the one
class of qgather.model.case (`ShardLayout`) and the one function of qgather.model.layout
(`column_block`) the reference uses, and a stand-in for the zoo's adapter base (`Mutant`), which
the parameter classes do not use."""

from __future__ import annotations

import importlib
import inspect
import re

from qgather.model.case import ShardLayout
from qgather.model.layout import column_block

__all__ = ["PACKAGE", "class_path", "sources"]

PACKAGE = "qref"
_FORMATS = ("numerics", "base", "fp8_tensor", "fp8_block", "mxfp8", "nvfp4")
_REFERENCE = ("wire", "ops", "traced", "hooks", "param")
_NOT_COPIED = ("qgather.impls.mutants.base", "qgather.impls.mutants.table")


# The formats' registry as a script needs it: the built-in formats by name, no user format to load.
_REGISTRY = '''"""Generated: qgather.formats.registry's table of formats; a script loads no format of its own."""

FORMATS = {}


class FormatLoadError(ValueError):
    pass


def register_format(fmt, builtin=False):
    FORMATS[fmt.name] = fmt
    return fmt


def load_format(spec):
    raise FormatLoadError(f"a standalone script loads no format of its own ({spec})")


def load_entry_point_formats():
    return []


def user_formats():
    return {}
'''


def sources(param_class: type) -> dict[str, str]:
    """Module name (under `qref`) -> source, in execution order, for a script built on `param_class`
    (the reference's QuantizedParam or a mutant's subclass of it)."""
    out = {PACKAGE: "", f"{PACKAGE}.errors": _copied("qgather.errors")}
    out.update({f"{PACKAGE}.formats.{name}": _copied(f"qgather.formats.{name}") for name in _FORMATS})
    out[f"{PACKAGE}.formats.registry"] = _REGISTRY
    out[f"{PACKAGE}.formats"] = _copied("qgather.formats")
    out[f"{PACKAGE}.model"] = ""
    out[f"{PACKAGE}.model.case"] = _generated("qgather.model.case", ShardLayout,
                                              "import math\nfrom dataclasses import dataclass\n")
    out[f"{PACKAGE}.model.layout"] = _generated("qgather.model.layout", column_block,
                                                f"from {PACKAGE}.formats import FORMATS\n")
    out[f"{PACKAGE}.impls"] = ""
    out.update({f"{PACKAGE}.impls.reference.{name}": _copied(f"qgather.impls.reference.{name}")
                for name in _REFERENCE})
    out[f"{PACKAGE}.impls.reference"] = (
        f"from {PACKAGE}.impls.reference.param import QuantizedParam, ShardAlignmentError\n"
        f"from {PACKAGE}.impls.reference.wire import WireLayout, WireMeta, WireMode\n")
    mutants = _mutant_modules(param_class.__module__)
    if mutants:
        out[f"{PACKAGE}.impls.mutants"] = ""
        out[f"{PACKAGE}.impls.mutants.base"] = (
            '"""Generated: qgather\'s zoo adapter base, which the parameter classes do not use."""\n\n\n'
            "class Mutant:\n    pass\n")
        out.update({_renamed(name): _copied(name) for name in mutants})
    return out


def reference_formats() -> tuple[str, ...]:
    """The formats the carried sources hold (every built-in one)."""
    from qgather.formats import FORMATS  # deferred: the formats import torch; a bad id is refused before

    return tuple(name for name, fmt in FORMATS.items() if type(fmt).__module__.rpartition(".")[2] in _FORMATS)


def class_path(param_class: type) -> str:
    """`module:Class` of the parameter class, under `qref`."""
    return f"{_renamed(param_class.__module__)}:{param_class.__qualname__}"


def _mutant_modules(module_name: str) -> list[str]:
    """The zoo modules `module_name` needs (itself last), or [] for a class outside the zoo."""
    if not module_name.startswith("qgather.impls.mutants."):
        return []
    needed: list[str] = []
    for imported in re.findall(r"^from (qgather\.impls\.mutants\.\w+) import", _source(module_name), re.M):
        if imported not in _NOT_COPIED:
            needed += [m for m in _mutant_modules(imported) if m not in needed]
    return [*needed, module_name]


def _source(module_name: str) -> str:
    return inspect.getsource(importlib.import_module(module_name))


def _renamed(text: str) -> str:
    return re.sub(r"\bqgather\.", f"{PACKAGE}.", text)


def _copied(module_name: str) -> str:
    text = _renamed(_source(module_name))
    if "'''" in text:  # the script holds each source in a ''' string
        raise ValueError(f"{module_name} holds ''': it cannot be carried as a standalone script's source")
    return text


def _generated(module_name: str, obj, imports: str) -> str:
    return (f'"""Generated: `{obj.__name__}` of {module_name}, all the reference uses of it."""\n\n'
            f"from __future__ import annotations\n\n{imports}\n\n{inspect.getsource(obj)}")
