"""Whether an error an implementation raised is one of the refusals it declares (`rejection_types`).

An adapter declares the errors with which it refuses a shape in two ways:

- a class (`ShardAlignmentError`): matched by its qualified name, "module.qualname", against every
  class of the raised error's MRO (`RankError.type_qualnames`, or the exception's own classes), so
  that a user's class that happens to share a built-in class's name is never taken for it;
- a string, for a library's class the adapter cannot import: `"Name"`, or `"Name: message prefix"`
  where a broad type (AssertionError) is a refusal only with that message; matched by the bare class
  name against every class of the error's MRO (`RankError.type_names`).

Example:
    >>> rules = DeclaredRejections.of((ValueError, "AssertionError: FSDP2 requires"))
    >>> rules.matches(ValueError("17 rows")), rules.matches(AssertionError("FSDP2 requires M % 16"))
    (True, True)
    >>> rules.matches(AssertionError("another assertion"))
    False
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qgather.errors import AdapterError, qualified_name

RejectionType = type[BaseException] | str


def _qualnames(error: object) -> tuple[str, ...]:
    """"module.qualname" of every class of the error's MRO: the record's, else the exception's own."""
    names = tuple(getattr(error, "type_qualnames", ()) or ())
    if not names and isinstance(error, BaseException):
        names = tuple(qualified_name(c) for c in type(error).__mro__)
    return names


def _bare_names(error: object) -> tuple[str, ...]:
    """The bare class name of every class of the error's MRO."""
    names = tuple(getattr(error, "type_names", ()) or ())
    if names:
        return names
    if isinstance(error, BaseException):
        return tuple(c.__name__ for c in type(error).__mro__)
    return (_type_name(error),)


def _type_name(error: object) -> str:
    return getattr(error, "type_name", None) or type(error).__name__


def _message(error: object) -> str:
    """The first line of the error's message (a RankError's `message`, else str(exception))."""
    message = getattr(error, "message", None)
    if message is None:
        message = str(error)
    return (message.strip().splitlines() or [""])[0]


@dataclass(frozen=True)
class DeclaredRejections:
    """An implementation's declared rejection types, split by how each is matched."""

    classes: tuple[type[BaseException], ...] = ()
    names: tuple[tuple[str, str], ...] = ()  # (bare class name, message prefix; "" for any message)

    @classmethod
    def of(cls, declared: Iterable[object], owner: str = "an implementation") -> DeclaredRejections:
        """The declaration `declared` (an adapter's `rejection_types`), checked: each entry is an
        exception class or a non-empty string; anything else is an AdapterError naming `owner`."""
        classes, names = [], []
        for entry in declared:
            if isinstance(entry, type) and issubclass(entry, BaseException):
                classes.append(entry)
            elif isinstance(entry, str) and entry.partition(": ")[0]:
                name, _, prefix = entry.partition(": ")
                names.append((name, prefix))
            else:
                raise AdapterError(f"{owner}: rejection_types holds {entry!r}, neither an exception class nor "
                                   "a class name (\"Name\" or \"Name: message prefix\")")
        return cls(tuple(classes), tuple(names))

    def matches(self, error: object) -> bool:
        """Whether `error` (a RankError or an exception) is one of the declared refusals."""
        qualnames = set(_qualnames(error))
        if any(qualified_name(c) in qualnames for c in self.classes):
            return True
        bare, message = set(_bare_names(error)), _message(error)
        return any(name in bare and message.startswith(prefix) for name, prefix in self.names)

    def problem(self, error: object) -> str:
        """"" when `error` is a declared refusal, else one line saying it is not, naming the declared types."""
        if self.matches(error):
            return ""
        raised = _type_name(error)
        clash = any(c.__name__ == raised for c in self.classes)
        if clash:  # a class of the same bare name from another module: say which is which
            raised = next(iter(_qualnames(error)), raised)
        shown = sorted([qualified_name(c) if clash and c.__name__ == _type_name(error) else c.__name__
                        for c in self.classes] + [f"{n}: {p}" if p else n for n, p in self.names])
        return (f"{raised} is not one of the implementation's declared rejection types "
                f"({', '.join(shown) or 'none'}; Implementation.rejection_types)")

    def bare_names(self) -> frozenset[str]:
        """Every entry as a bare-name string ("Name" or "Name: prefix"), as classifiers matched before
        classes were matched by qualified name."""
        return frozenset([c.__name__ for c in self.classes] + [f"{n}: {p}" if p else n for n, p in self.names])
