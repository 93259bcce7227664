"""Covering designs for the default run: every pair of dimension values at least once.

Three problems, three greedy generators over one vocabulary (a label is (dimension, value); a pair is
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

`cover_pairs(candidates)`: the configuration sweeps (qgather.suite.config_sweep) list every valid case
of their space (qgather.suite.config_space), each with its labels (a case has every regime it hits,
so several labels of one dimension), and pick cases until every pair of labels of two dimensions
that some candidate holds is held by a picked one: validity comes from the candidates, so no
impossible pair is asked for. Each pick starts from the uncovered pair the fewest candidates hold
and takes, among those holding it, the one covering the most uncovered pairs.

The three choose differently (per factor, whole free combinations with pinned rows and primary
configurations, whole valid cases), so their designs differ even where two apply; each suite's case
ids are its generator's. `--exhaustive` runs the full product.
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


def cover_pairs(candidates: Sequence[frozenset[Label]]) -> list[int]:
    """Indices, in increasing order, of candidates (label sets) that together hold every pair of labels
    of two dimensions that some candidate holds (deterministic, greedy)."""
    labels = sorted({label for c in candidates for label in c}, key=repr)
    ids = {label: i for i, label in enumerate(labels)}
    n = len(labels)
    held = []
    for c in candidates:
        mine = sorted(ids[label] for label in c)
        held.append([a * n + b for a, b in combinations(mine, 2) if labels[a][0] != labels[b][0]])
    holders: list[set[int]] = [set() for _ in labels]
    count: dict[int, int] = {}
    for index, c in enumerate(candidates):
        for label in c:
            holders[ids[label]].add(index)
    for pairs in held:
        for p in pairs:
            count[p] = count.get(p, 0) + 1
    uncovered = set(count)
    chosen: list[int] = []
    while uncovered:
        rarest = min(uncovered, key=lambda p: (count[p], p))
        a, b = divmod(rarest, n)
        best = max(sorted(holders[a] & holders[b]), key=lambda i: sum(p in uncovered for p in held[i]))
        chosen.append(best)
        uncovered.difference_update(held[best])
    return sorted(chosen)
