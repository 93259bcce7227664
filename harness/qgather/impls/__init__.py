"""The registry of implementations under test: `get_impl(name)` loads, checks and caches an adapter.

Built-in names: `reference`, `mutant:<bug>` (the bug zoo), `torchao`, `te` adapters. External
implementations load without editing qgather, either
  - on the command line: `--impl package.module:object` (an Implementation subclass or instance), or
  - through the `qgather.impls` entry-point group: `name = "package.module:object"`.
Every adapter, built-in or not, is checked when it is loaded: one that lacks a method it needs
(`qgather.impls.base.missing_methods`) or declares its rejection types wrongly is refused with
one line, an `AdapterLoadError` naming it and what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from qgather.errors import AdapterError, UsageError, first_line
from qgather.formats import FormatLoadError, load_format, register_format
from qgather.impls.base import Implementation, missing_methods
from qgather.impls.rejections import DeclaredRejections
from qgather.model.names import impl_choices
from qgather.paths import import_user_module, not_importable

__all__ = ["AdapterLoadError", "UnknownImplementationError", "adapter_module", "available", "get_impl"]

Factory = Callable[[], Implementation]



class UnknownImplementationError(UsageError, LookupError):
    """No implementation of that name, or one that cannot be loaded: the message says which and why."""


class AdapterLoadError(AdapterError, UnknownImplementationError):
    """An adapter refused at load (a required method missing, rejection types that are neither
    classes nor names). An AdapterError; also an UnknownImplementationError, so that every caller
    that reports a failed lookup in one line reports this one too."""


def _builtin() -> dict[str, Factory]:
    """The built-in adapters by name: each module that registers some has FACTORIES (name -> class).
    Imported on the first lookup, like entry points: the adapters (torch, TE's and torchao's glue)
    load only when an implementation is asked for, not wherever base or rejections are."""
    from qgather.impls import mutants, reference, te
    from qgather.impls.torchao import adapter as torchao

    return {**reference.FACTORIES, **mutants.FACTORIES, **torchao.FACTORIES, **te.FACTORIES}


def _builtin_families() -> set[str]:
    """The first words of the built-in names (`reference`, `mutant`, `te`, `torchao`): `mutant:x` is one
    of the zoo, never a module `mutant` with an object `x`."""
    return {name.partition(":")[0] for name in _builtin()}


def adapter_module(name: str) -> str | None:
    """The module a `package.module:object` implementation name imports (a user's adapter), or None
    for a built-in or entry-point name.

    Example:
        >>> adapter_module("mypkg.adapters:MyImpl"), adapter_module("mutant:nibble_swap")
        ('mypkg.adapters', None)
    """
    module_name, sep, _ = name.partition(":")
    if not sep or name in _from_entry_points() or module_name in _builtin_families():
        return None
    return module_name


def _from_entry_points() -> dict[str, Factory]:
    return {ep.name: ep.load for ep in entry_points(group="qgather.impls")}


def _load_object(target: str) -> Implementation:
    module_name, _, attr = target.partition(":")
    if not attr:
        raise UnknownImplementationError(
            f"implementation {target!r}: external implementations are named package.module:object"
        )
    try:
        obj = getattr(import_user_module(module_name), attr)
    except ModuleNotFoundError as exc:
        raise UnknownImplementationError(f"implementation {target!r}: {not_importable(module_name, exc)}") from None
    except (ImportError, AttributeError) as exc:
        raise UnknownImplementationError(f"implementation {target!r}: cannot load it ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a broken adapter module (SyntaxError, error at import)
        raise UnknownImplementationError(
            f"implementation {target!r}: importing {module_name!r} failed ({_told(exc)})"
        ) from None
    return _instantiate(target, obj)


def _told(exc: BaseException) -> str:
    """"Type: first line of the message", for a one-line refusal."""
    return f"{type(exc).__name__}: {first_line(exc, 200) or 'no message'}"


def _refuse_incomplete(name: str, adapter: type[Implementation] | Implementation) -> None:
    """Raise AdapterLoadError when the adapter lacks a method it needs or misdeclares its rejections."""
    cls = adapter if isinstance(adapter, type) else type(adapter)
    missing = missing_methods(adapter)
    if missing:
        raise AdapterLoadError(f"implementation {name!r} ({cls.__module__}.{cls.__qualname__}) cannot be used: "
                               f"it does not implement {'; '.join(missing)}")
    try:
        DeclaredRejections.of(adapter.rejection_types, f"implementation {name!r}")
    except AdapterError as exc:
        raise AdapterLoadError(str(exc)) from None


def _instantiate(name: str, obj: object) -> Implementation:
    """The adapter `obj` names (an Implementation subclass, built here, or an instance), checked."""
    is_adapter_class = isinstance(obj, type) and issubclass(obj, Implementation)
    if is_adapter_class:
        _refuse_incomplete(name, obj)  # before construction: an abstract class cannot be built
    try:
        impl = obj() if is_adapter_class else obj
    except Exception as exc:  # noqa: BLE001 - the adapter's own constructor failed
        raise UnknownImplementationError(
            f"implementation {name!r}: constructing {obj.__name__} failed ({_told(exc)})"
        ) from None
    if not isinstance(impl, Implementation):
        raise UnknownImplementationError(
            f"implementation {name!r} is a {type(impl).__name__}, not a qgather.impls.base.Implementation"
        )
    _refuse_incomplete(name, impl)  # again on the instance: its constructor may set `scenarios`
    impl.formats = _registered_formats(name, impl.formats)
    return impl


def _registered_formats(name: str, formats: object) -> tuple[str, ...]:
    """The names of the formats an adapter lists, each of its own formats (a Format, its class, or
    "package.module:Class") registered in qgather.formats.FORMATS on the way: loading the adapter makes
    them known, in every process that loads it (the ranks too)."""
    if isinstance(formats, str) or not isinstance(formats, (tuple, list)):
        raise AdapterLoadError(f"implementation {name!r}: formats must be a tuple of format names or formats, "
                               f"got {formats!r}")
    try:
        return tuple(_format_name(f"implementation {name!r}", fmt) for fmt in formats)
    except FormatLoadError as exc:
        raise AdapterLoadError(str(exc)) from None


def _format_name(where: str, fmt: object) -> str:
    """A built-in or registered format's name as it is; a format of the adapter's own registered first."""
    if isinstance(fmt, str):
        return load_format(fmt, f"{where}: format {fmt!r}") if ":" in fmt else fmt
    return register_format(fmt, where)


def _load_entry_point(name: str, load: Factory) -> object:
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin package
        raise UnknownImplementationError(
            f"implementation {name!r} (qgather.impls entry point) failed to load ({_told(exc)})"
        ) from None


def available() -> list[str]:
    """Every implementation name this process can load: the built-ins and the entry points."""
    return sorted({*_builtin(), *_from_entry_points()})


_CACHE: dict[str, Implementation] = {}


def get_impl(name: str) -> Implementation:
    """The implementation called `name`: built-in, entry point, or package.module:object.

    Args:
        name: e.g. "reference", "mutant:nibble_swap", "mypkg.adapters:MyImpl".
    Returns:
        The adapter instance, loaded once per process (cached).
    Raises:
        UnknownImplementationError: no such name, or it cannot be imported or built;
            AdapterLoadError (a subclass) when the adapter is incomplete.
    """
    if name in _CACHE:
        return _CACHE[name]
    builtin, plugins = _builtin(), _from_entry_points()
    if name in builtin:
        impl = _instantiate(name, builtin[name])
    elif name in plugins:
        impl = _instantiate(name, _load_entry_point(name, plugins[name]))
    elif adapter_module(name) is not None:  # a misspelt `mutant:x` is unknown, not "cannot import mutant"
        impl = _load_object(name)
    else:
        known = impl_choices({*builtin, *plugins})
        raise UnknownImplementationError(f"unknown implementation {name!r}; available: {known}")
    if not impl.name:
        impl.name = name
    _CACHE[name] = impl
    return impl
