"""The formats by name (`FORMATS`), and how a format of your own joins them: `register_format` checks it
against the Format protocol (qgather.formats.base.Format) and adds it; `load_format("pkg.mod:Class")`
imports it first, from the current directory as an adapter is (qgather.paths.import_user_module).

A format joins by any of three routes, all ending in `register_format`:
  - an adapter lists it in `formats` (the object, its class or "pkg.mod:Class"): loading the adapter
    registers it, on every rank as in the command's process, so case ids carry only its name;
  - `--formats pkg.mod:Class` on the command line;
  - a `qgather.formats` entry point of an installed package (`name = "pkg.mod:Class"`), at import.

    register_format(Fp8RowwiseFormat())        -> "fp8_rowwise"
    load_format("mypkg.rowwise:Fp8RowwiseFormat", "--formats")
"""

from __future__ import annotations

import math
import re
import sys
from importlib.metadata import entry_points

import torch

from qgather.errors import UsageError, first_line
from qgather.paths import import_user_module, not_importable

from .base import Format, FormatError, QuantizedTensor

FORMATS: dict[str, Format] = {}
BUILTIN: set[str] = set()  # the names qgather itself registers (qgather.formats): the rest are users'

#: what every format defines (the Format protocol); columnwise dequantization only where it has columnwise buffers
REQUIRED_HOOKS = ("buffer_specs", "valid_regions", "row_specs", "_quantize", "_dequantize", "_to_rows", "_from_rows")
#: a format's name goes into case ids (`impl:format:MxK:...`): no colon, nothing a shell would split
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class FormatLoadError(UsageError):
    """A format that cannot be loaded or does not keep the Format protocol: one line naming it and why."""


def register_format(fmt: Format | type[Format], where: str = "format", builtin: bool = False) -> str:
    """Add `fmt` (a Format, or a Format subclass, built here) to FORMATS once it keeps the Format protocol;
    its name. Registering the same format class under its name again is a no-op.

    Args:
        fmt: the format (or its class).
        where: what named it, for the one-line refusal (e.g. "--formats 'mypkg.rowwise:Fmt'").
    Raises:
        FormatLoadError: not a Format, a name a case id cannot carry, a name another format holds, a hook
            left undefined, or rules its own quantization does not keep (`check_protocol`).
    """
    if isinstance(fmt, type) and issubclass(fmt, Format):
        try:
            fmt = fmt()
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise FormatLoadError(f"{where}: constructing {fmt.__name__} failed ({_told(exc)})") from None
    if not isinstance(fmt, Format):
        raise FormatLoadError(f"{where}: a {type(fmt).__name__}, not a qgather.formats.Format")
    name = fmt.name
    if not isinstance(name, str) or not NAME.match(name):
        raise FormatLoadError(f"{where}: format name {name!r} cannot go into a case id "
                              "(letters, digits, '_', '.', '-'; no ':')")
    held = FORMATS.get(name)
    if held is not None:
        if type(held) is type(fmt):
            return name
        raise FormatLoadError(f"{where}: format name {name!r} is taken by {_class_name(held)}")
    if not builtin:
        check_protocol(fmt, where)
    else:
        BUILTIN.add(name)
    FORMATS[name] = fmt
    return name


def load_format(target: str, where: str) -> str:
    """Import the format `target` names ("pkg.mod:Class" or "pkg.mod:instance", from the current directory
    when not installed) and register it; its name. A FormatLoadError (one line) names `where` and why."""
    module_name, _, attr = target.partition(":")
    if not attr or not module_name:
        raise FormatLoadError(f"{where}: a format of your own is named package.module:Class, not {target!r}")
    try:
        obj = getattr(import_user_module(module_name), attr)
    except ModuleNotFoundError as exc:
        raise FormatLoadError(f"{where}: {not_importable(module_name, exc)}") from None
    except AttributeError:
        raise FormatLoadError(f"{where}: module {module_name!r} has no {attr!r}") from None
    except Exception as exc:  # noqa: BLE001 - a broken module (SyntaxError, an error at import)
        raise FormatLoadError(f"{where}: importing {module_name!r} failed ({_told(exc)})") from None
    return register_format(obj, where)


def missing_hooks(fmt: Format) -> list[str]:
    """The Format protocol's hooks `fmt` leaves undefined (empty: none)."""
    hooks = [*REQUIRED_HOOKS, *(("_dequantize_columnwise",) if fmt.has_columnwise else ())]
    return [h for h in hooks if getattr(type(fmt), h) is getattr(Format, h)]


def check_protocol(fmt: Format, where: str) -> None:
    """FormatLoadError unless `fmt` defines every hook and keeps its own rules on a probe tensor: the
    buffers its `_quantize` makes are those `buffer_specs` declares, `to_rows` gives `row_specs`' rows for
    the `rows_per_entry` keys, and `from_rows(to_rows(q))` is q bit for bit (what the golden of a
    gathered weight is built with)."""
    missing = missing_hooks(fmt)
    if missing:
        raise FormatLoadError(f"{where}: format {fmt.name!r} does not define {', '.join(missing)} "
                              "(qgather.formats.base.Format)")
    for attr in ("row_block", "k_multiple", "m_multiple"):
        value = getattr(fmt, attr)
        if not isinstance(value, int) or value < 1:
            raise FormatLoadError(f"{where}: format {fmt.name!r}: {attr} must be an int >= 1, got {value!r}")
    problem = _probe_problem(fmt)
    if problem:
        raise FormatLoadError(f"{where}: format {fmt.name!r} breaks its own rules: {problem}")


def _probe_problem(fmt: Format) -> str:
    """Why `fmt`'s quantization of a small tensor disagrees with its declared layout ("" when it agrees)."""
    m = 2 * math.lcm(fmt.row_block, fmt.m_multiple, 2)
    shape = (m, math.lcm(fmt.k_multiple, 16) * 2)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    try:
        q = fmt.quantize(x)
        specs = fmt.buffer_specs(shape)
        got = {name: (tuple(t.shape), t.dtype) for name, t in q.buffers.items()}
        want = {name: (tuple(s), dtype) for name, (s, dtype) in specs.items()}
        if got != want:
            return f"quantize made buffers {_layout(got)}, buffer_specs declares {_layout(want)}"
        if set(fmt.valid_regions(shape)) != set(specs):
            return f"valid_regions names {sorted(fmt.valid_regions(shape))}, buffer_specs {sorted(specs)}"
        rows, glob = fmt.to_rows(q)
        if set(rows) != set(fmt.rows_per_entry) or set(glob) != set(fmt.glob_keys):
            return (f"to_rows gives rows {sorted(rows)} and per-tensor {sorted(glob)}, the format declares "
                    f"rows_per_entry {sorted(fmt.rows_per_entry)} and glob_keys {sorted(fmt.glob_keys)}")
        again = fmt.from_rows(rows, glob, shape)
    except (FormatError, NotImplementedError, RuntimeError, ValueError, TypeError, KeyError) as exc:
        return f"on a {shape[0]}x{shape[1]} tensor: {_told(exc)}"
    if not isinstance(again, QuantizedTensor):
        return "from_rows did not return a QuantizedTensor"
    differences = again.mismatches(q, valid_only=True)
    return f"from_rows(to_rows(q)) is not q ({'; '.join(differences)})" if differences else ""


def _layout(specs: dict) -> str:
    return ", ".join(f"{name} {str(dtype).removeprefix('torch.')}{shape}"
                     for name, (shape, dtype) in sorted(specs.items()))


def _class_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _told(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc, 200) or 'no message'}"


def load_entry_point_formats() -> None:
    """Formats from other packages (`qgather.formats` entry points: name = "pkg.mod:FormatClass"),
    registered at import so that every option check and listing sees them; one that fails is one line on
    stderr, and the harness goes on without it."""
    for ep in entry_points(group="qgather.formats"):
        try:
            register_format(ep.load(), f"format entry point {ep.name!r}")
        except FormatLoadError as exc:
            print(f"qgather: {exc}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the harness down
            print(f"qgather: format entry point {ep.name!r} failed to load ({_told(exc)})", file=sys.stderr)


def user_formats() -> list[str]:
    """The names of the formats registered from outside qgather (entry points, adapters, --formats)."""
    return [name for name in FORMATS if name not in BUILTIN]
