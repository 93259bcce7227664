"""The bug zoo: one deliberately broken variant of the reference implementation per bug class of
docs/bug-classes.md, so that the harness can prove it detects (and names) every one of them.

Each mutant is the reference `QuantizedParam` with one small method overridden (or, where the bug
lives in the optimizer-step path, one method of the reference adapter), modelled on how that bug
occurs in real FSDP2 hooks of TransformerEngine / torchao-style tensor subclasses; each behaviour
class's docstring says which real failure it models.

  table.py     ZOO: one row per mutant (bug, bug class, parameter class, verdicts, catching case, doc)
  base.py      MutantSpec (a row) and Mutant (the adapter a row builds)
  sharding.py  wire.py  state.py  group.py   the broken behaviours, by where the bug lives

`qgather.impls` registers `FACTORIES`, so every mutant runs like any implementation:
`qgather case mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0`.
"""

from __future__ import annotations

from qgather.impls.mutants.base import Mutant, MutantSpec
from qgather.impls.mutants.table import ZOO

__all__ = ["FACTORIES", "MUTANTS", "ZOO", "Mutant", "MutantSpec"]

#: every mutant's implementation class, by bug class
MUTANTS: tuple[type[Mutant], ...] = tuple(spec.build() for spec in sorted(ZOO, key=lambda s: s.bug_class))

FACTORIES: dict[str, type[Mutant]] = {m.name: m for m in MUTANTS}
