"""Every error qgather raises on purpose, in one hierarchy, so that callers catch by kind.

- `UsageError`: the user asked for something that cannot run (a case id, an option, a selection, a
  file): one line, exit code 4 in the CLI, `pytest.UsageError` in the plugin.
- `HarnessFault`: qgather's own glue around an implementation broke; never counted as the
  implementation refusing a shape, whatever it says.
- `AdapterError`: an implementation adapter that cannot be loaded or used as it is written.
- `Refusal`: an implementation (or a format) refusing a shape it cannot hold, naming the constraint;
  a verdict is REJECTED only when the implementation declares the refusal's class
  (`Implementation.rejection_types`) and every rank raises it before any data moved.

And how any error is named and told, in one place each: `qualified_name` (what a rank records of
an exception's classes and what a declared rejection class is matched by) and `first_line`.
"""

from __future__ import annotations


class QgatherError(Exception):
    """Base of every error qgather raises on purpose."""


class UsageError(QgatherError, ValueError):
    """The user's input cannot describe anything that runs: the message says what and why. Exit
    code 4 (pytest's usage error) in the CLI and the plugin alike (README's "Exit codes")."""


class HarnessFault(QgatherError, RuntimeError):
    """An error in the harness's own glue around an implementation (an adapter's emulation or
    bookkeeping): never counted as the implementation rejecting a shape."""


class AdapterError(QgatherError, TypeError):
    """An adapter that cannot be used as written (e.g. a required method missing)."""


class Refusal(QgatherError, ValueError):
    """A shape refused with the constraint it violates named (a format that cannot hold it, a shard
    that is not aligned to the scale block)."""


def qualified_name(cls: type) -> str:
    """A class as "module.qualname": what a rank records of each class of a raised error
    (qgather.runtime.outcome.RankError.type_qualnames) and what a declared rejection class is matched
    by (qgather.impls.rejections). One function, so that the REJECTED rule's two sides agree.

    Example:
        >>> qualified_name(Refusal)
        'qgather.errors.Refusal'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def first_line(text: object, limit: int | None = None) -> str:
    """The first line of `str(text)` (an exception, a reason), blank around it dropped; "" for none.
    Cut to `limit` characters, the last three "...", when it is longer.

    Example:
        >>> first_line("shard of 17 rows\n  in fsdp_pre_all_gather", limit=12)
        'shard of ...'
    """
    stripped = str(text or "").strip()
    line = stripped.splitlines()[0] if stripped else ""
    return line[: limit - 3] + "..." if limit is not None and len(line) > limit else line
