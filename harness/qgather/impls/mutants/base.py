"""What a mutant of the bug zoo is: `MutantSpec`, the record of one row of the zoo's table
(qgather.impls.mutants.table), and `Mutant`, the reference adapter that a record turns into an
implementation class (`MutantSpec.build`) carrying its bug's parameter class and verdicts.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import ClassVar

from qgather.impls.reference import QuantizedParam, ReferenceImplementation
from qgather.model.verdict import Verdict

__all__ = ["Mutant", "MutantSpec"]

#: where the built mutant classes live (MUTANTS, FACTORIES)
ZOO_MODULE = "qgather.impls.mutants"


class Mutant(ReferenceImplementation):
    """Base of the zoo's implementations: the reference adapter with a broken parameter class (or,
    for a bug in the optimizer-step path, a broken adapter method, in a subclass of this one).

    A built mutant class (`MutantSpec.build`) carries, from its record:
      bug             the mutant's name, `mutant:<bug>` its implementation name
      bug_class       the number of the bug class in docs/bug-classes.md
      expected        the verdict the harness must give it
      verdicts        every failing verdict consistent with the bug, `expected` included
                      (`qgather selftest --suite` counts any other failing verdict as wrong-class)
      catching_cases  case ids on which `expected` shows while the reference passes the same case
    """

    spec: ClassVar[MutantSpec | None] = None
    bug: str = ""
    bug_class: int = 0
    expected: Verdict = Verdict.EXACT
    verdicts: frozenset[Verdict] = frozenset()
    catching_cases: tuple[str, ...] = ()


@dataclass(frozen=True)
class MutantSpec:
    """One row of the bug zoo: a bug, where it lives, and the verdict that must catch it.

    Args:
        bug: the mutant's name (`mutant:<bug>`).
        bug_class: its section number in docs/bug-classes.md.
        param_class: the reference's QuantizedParam with the bug in one small method.
        expected: the verdict the harness must give it on its catching cases.
        catching: those cases, without the `mutant:<bug>:` prefix (e.g. "nvfp4_2d:128x64:bf16:ws2:gather:s0").
        doc: one line: what the bug does.
        also: the other failing verdicts consistent with the bug (where it may also show).
        adapter: the adapter class (a Mutant) when the bug lives in the adapter's optimizer-step path.
        formats: the formats it runs, when not every reference format has the bug.
    """

    bug: str
    bug_class: int
    param_class: type[QuantizedParam]
    expected: Verdict
    catching: tuple[str, ...]
    doc: str
    also: frozenset[Verdict] = frozenset()
    adapter: type[Mutant] = Mutant
    formats: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        """The implementation name, `mutant:<bug>`."""
        return f"mutant:{self.bug}"

    @property
    def verdicts(self) -> frozenset[Verdict]:
        """Every failing verdict consistent with the bug, `expected` included."""
        return self.also | {self.expected}

    @property
    def catching_cases(self) -> tuple[str, ...]:
        """The catching cases' full ids."""
        return tuple(f"{self.name}:{case}" for case in self.catching)

    @property
    def class_name(self) -> str:
        """The built class's name: the bug in CamelCase (nibble_swap -> NibbleSwap, derive_columnwise_1d ->
        DeriveColumnwise1D)."""
        return "".join(part.upper() if part[:1].isdigit() else part[:1].upper() + part[1:]
                       for part in self.bug.split("_"))

    def build(self) -> type[Mutant]:
        """The mutant's implementation class, as the registry loads it (qgather.impls.mutants.FACTORIES)."""
        attrs = {"__doc__": f"`{self.name}` (bug class {self.bug_class}): {self.doc}.", "__module__": ZOO_MODULE,
                 "spec": self, "bug": self.bug, "name": self.name, "bug_class": self.bug_class,
                 "expected": self.expected, "verdicts": self.verdicts, "catching_cases": self.catching_cases,
                 "param_class": self.param_class}
        if self.formats:
            attrs["formats"] = self.formats
        return types.new_class(self.class_name, (self.adapter,), exec_body=lambda ns: ns.update(attrs))
