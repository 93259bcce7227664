"""Implementations under test, by name.

Built-in names: `reference`, `mutant:<bug>` (the bug zoo), `torchao`, `te` adapters. External
implementations load without editing qgather, either
  - on the command line: `--impl package.module:object` (an Implementation subclass or instance), or
  - through the `qgather.impls` entry-point group: `name = "package.module:object"`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from qgather.impls.base import Implementation

Factory = Callable[[], Implementation]


class UnknownImplementationError(LookupError):
    pass


def _builtin() -> dict[str, Factory]:
    from qgather.impls.reference import ReferenceImplementation

    factories: dict[str, Factory] = {"reference": ReferenceImplementation}
    for module_name in ("qgather.impls.mutants", "qgather.impls.torchao.adapter", "qgather.impls.te"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # not built yet
            raise
        factories.update(module.FACTORIES)
    return factories


def _from_entry_points() -> dict[str, Factory]:
    return {ep.name: ep.load for ep in entry_points(group="qgather.impls")}


def _load_object(target: str) -> Implementation:
    module_name, _, attr = target.partition(":")
    if not attr:
        raise UnknownImplementationError(
            f"--impl {target!r}: external implementations are named package.module:object"
        )
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownImplementationError(f"--impl {target!r}: cannot load it ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a broken adapter module (SyntaxError, error at import)
        raise UnknownImplementationError(
            f"--impl {target!r}: importing {module_name!r} failed ({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    return _instantiate(target, obj)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "no message"


def _instantiate(name: str, obj) -> Implementation:
    is_adapter_class = isinstance(obj, type) and issubclass(obj, Implementation)
    try:
        impl = obj() if is_adapter_class else obj
    except Exception as exc:  # noqa: BLE001 - the adapter's own constructor failed
        raise UnknownImplementationError(
            f"implementation {name!r}: constructing {obj.__name__} failed ({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    if not isinstance(impl, Implementation):
        raise UnknownImplementationError(
            f"implementation {name!r} is a {type(impl).__name__}, not a qgather.impls.base.Implementation"
        )
    return impl


def _load_entry_point(name: str, load: Factory):
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin package
        raise UnknownImplementationError(
            f"implementation {name!r} (qgather.impls entry point) failed to load ({type(exc).__name__}: "
            f"{_first_line(exc)})"
        ) from None


def available() -> list[str]:
    return sorted({*_builtin(), *_from_entry_points()})


_CACHE: dict[str, Implementation] = {}
# Prefixes of built-in families, so that a misspelt `mutant:x` is "unknown", not "cannot import mutant".
_BUILTIN_PREFIXES = ("mutant", "torchao", "te")


def get_impl(name: str) -> Implementation:
    """The implementation called `name` (built-in, entry point, or package.module:object)."""
    if name in _CACHE:
        return _CACHE[name]
    builtin, plugins = _builtin(), _from_entry_points()
    if name in builtin:
        impl = _instantiate(name, builtin[name])
    elif name in plugins:
        impl = _instantiate(name, _load_entry_point(name, plugins[name]))
    elif ":" in name and name.partition(":")[0] not in _BUILTIN_PREFIXES:
        impl = _load_object(name)
    else:
        raise UnknownImplementationError(
            f"unknown implementation {name!r}; available: {', '.join(sorted({*builtin, *plugins}))} "
            "(or package.module:object)"
        )
    if not impl.name:
        impl.name = name
    _CACHE[name] = impl
    return impl
