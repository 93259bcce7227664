"""Covering designs for the default run: every pair of dimension values at least once.

Two problems, two greedy generators over one vocabulary (a label is (dimension, value); a pair is
two labels in sorted order):

`pairwise(factors)`: a covering array of strength 2 over independent factors (qgather.suite.config_sweep).
Each new case starts from the first pair not yet covered and fills the other factors one by one with
the value that covers the most uncovered pairs.

`pairwise_over_rows(rows, combos, ...)`: a sweep's *rows* (implementation, format, shape, world
size, scenario) all run: they carry the regimes that qgather.suite.shape_space promises, so a row has
several labels of one dimension and is not a choice of one value per factor. The *free* dimensions
(dtype, seed, FSDP2 configuration) are not crossed with every row; each row gets one (dtype, seed)
under the sweep's first configuration, chosen greedily so that every pair of values of two
dimensions (free with free, free with a row's format, world size, scenario or regime) occurs, then
cases of the other configurations are added until their pairs occur too (qgather.suite.sweeps.Sweep).

The two choose differently (per factor vs. whole free combinations, with validity, pinned rows and
primary configurations), so their designs differ even where both apply; each suite's case ids are
its generator's. `--exhaustive` runs the full product.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from itertools import combinations

Label = tuple[Hashable, Hashable]  # (dimension, value); pairwise names a factor by its index
Pair = tuple[Label, Label]


def _pairs(fixed: frozenset[Label], free: tuple[Label, ...]) -> frozenset[Pair]:
    """The pairs of labels with at least one free value (fixed-with-fixed pairs come with every row)."""
    out = set()
    for a, b in combinations(free, 2):
        out.add((a, b) if a <= b else (b, a))
    for a in free:
        for b in fixed:
            out.add((a, b) if a <= b else (b, a))
    return frozenset(out)


def pairwise(factors: Sequence[Sequence[Hashable]]) -> list[tuple[Hashable, ...]]:
    """Rows of a covering array of strength 2 over `factors` (deterministic, greedy); factor i's
    value v is the label (i, v)."""
    uncovered = set()
    for i, j in combinations(range(len(factors)), 2):
        uncovered |= {((i, a), (j, b)) for a in factors[i] for b in factors[j]}
    rows = []
    while uncovered:
        (i, a), (j, b) = min(uncovered)
        row: dict[int, Hashable] = {i: a, j: b}
        for k in range(len(factors)):
            if k not in row:
                labels = frozenset(row.items())
                row[k] = max(factors[k], key=lambda v, k=k: len(_pairs(labels, ((k, v),)) & uncovered))
        full = tuple(row[k] for k in range(len(factors)))
        uncovered -= _pairs(frozenset(), tuple(enumerate(full)))
        rows.append(full)
    return rows


def pairwise_over_rows(
    rows: Sequence[Hashable],
    combos: Sequence[tuple],
    fixed_labels: Callable[[Hashable], frozenset[Label]],
    free_labels: Callable[[tuple], tuple[Label, ...]],
    valid: Callable[[Hashable, tuple], bool],
    pinned: Callable[[Hashable], bool],
    primary: Callable[[tuple], bool],
) -> list[tuple[Hashable, tuple]]:
    """(row, combo) cases: each row once with a primary combo (a pinned row with the first valid one),
    then extra cases until every achievable pair is covered."""
    fixed = {row: fixed_labels(row) for row in rows}
    free = {combo: free_labels(combo) for combo in combos}
    options = {row: [c for c in combos if valid(row, c)] for row in rows}
    out: list[tuple[Hashable, tuple]] = []
    covered: set[Pair] = set()
    for row in rows:
        firsts = [c for c in options[row] if primary(c)]
        if not firsts:
            continue
        pick = firsts[0] if pinned(row) else max(firsts, key=lambda c: len(_pairs(fixed[row], free[c]) - covered))
        out.append((row, pick))
        covered |= _pairs(fixed[row], free[pick])
    required = set()
    for row in rows:
        for combo in options[row]:
            required |= _pairs(fixed[row], free[combo])
    missing = required - covered
    chosen = set(out)
    while missing:
        a, b = min(missing, key=repr)
        best, best_new = None, set()
        for row in rows:
            labels = fixed[row]
            for combo in options[row]:
                if (row, combo) in chosen:
                    continue
                have = labels.union(free[combo])
                if a in have and b in have:
                    new = _pairs(labels, free[combo]) & missing
                    if len(new) > len(best_new):
                        best, best_new = (row, combo), new
        if best is None:  # unreachable: every required pair came from some (row, combo)
            missing.discard((a, b))
            continue
        out.append(best)
        chosen.add(best)
        missing -= best_new
    return out
