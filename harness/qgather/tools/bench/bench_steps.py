"""The steps of one benchmarked case across its ranks (`qgather bench gpu`): per step the slowest
and the fastest rank, and each of qgather's own steps against its HBM floor as a goal.

A collective starts only when the last rank reaches it, so a rank's "collective" seconds include
waiting for the others. Each rank notes when it first entered the collective (RankResult.started,
one wall clock for the ranks of a host); the wait is the time from its arrival to the last rank's,
and the collective's own seconds are what is left (`split_waits`). The rank that arrived last is
the one whose earlier work the others waited for, and that work says whose wait it is: as much of
it as the last rank spent longer than the waiting one in the library's own steps before the
collective (its sharded module build, FSDP2's unshard up to the collective) is a wait on the
library (WAIT_ON_LIBRARY), the rest a wait on qgather's steps or on no one's (WAIT, held to a floor).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from qgather.model.phases import Phase, Step

WAIT = "wait before the collective"
WAIT_ON_LIBRARY = "wait on the library's steps"
COLLECTIVE = Phase.COLLECTIVE.value
#: the library's own steps before a gather case's collective (the one-device twin, the golden and the
#: build/quantize step, the case's data, are qgather's)
LIBRARY_BEFORE_COLLECTIVE = (Step.SHARDED_MODULE.value, Phase.SHARD.value, Phase.PRE_HOOK.value)
#: every step of a gather case that is the library's own work (FSDP2's and the library's, waits on them
#: included): what the case would take were qgather's own steps (its data, golden, twin, inspection) free
LIBRARY_STEPS = (Step.SHARDED_MODULE.value, Phase.SHARD.value, Phase.PRE_HOOK.value, COLLECTIVE,
                 Phase.POST_HOOK.value, Step.LIBRARY_FORWARD.value, Step.RESHARD.value, WAIT_ON_LIBRARY)
#: qgather's own steps (not the library's), each held to FLOOR_GOAL times its HBM floor
OWN_STEPS = (Step.GOLDEN.value, Phase.INSPECTION.value, Step.TWIN.value, WAIT)
FLOOR_GOAL = 5.0


@dataclass(frozen=True)
class RankSteps:
    """One rank's steps in one rep: seconds per step, and the wall-clock second each first started."""

    rank: int
    seconds: Mapping[str, float]
    started: Mapping[str, float]


@dataclass(frozen=True)
class StepSpread:
    """One step over the ranks: the slowest and the fastest rank's seconds."""

    step: str
    slowest_s: float
    slowest_rank: int
    fastest_s: float
    fastest_rank: int


def split_waits(ranks: Sequence[RankSteps]) -> tuple[list[RankSteps], int | None]:
    """Each rank's collective split into the wait for the last rank to arrive and the rest
    (COLLECTIVE), the wait into the part the last rank spent longer in the library's steps before the
    collective (WAIT_ON_LIBRARY) and the rest (WAIT); and the rank that arrived last (None, and the
    ranks unchanged, when a rank never reached a collective). A gather case: one collective."""
    arrivals = {r.rank: r.started.get(COLLECTIVE) for r in ranks}
    if not arrivals or any(a is None for a in arrivals.values()):
        return list(ranks), None
    last_rank = max(arrivals, key=lambda rank: arrivals[rank])
    last = next(r for r in ranks if r.rank == last_rank)
    split = []
    for r in ranks:
        total = r.seconds.get(COLLECTIVE, 0.0)
        wait = min(max(arrivals[last_rank] - arrivals[r.rank], 0.0), total)
        on_library = min(max(_library_seconds(last) - _library_seconds(r), 0.0), wait)
        split.append(replace(r, seconds={**r.seconds, WAIT: wait - on_library, WAIT_ON_LIBRARY: on_library,
                                         COLLECTIVE: total - wait}))
    return split, last_rank


def _library_seconds(r: RankSteps) -> float:
    return sum(r.seconds.get(step, 0.0) for step in LIBRARY_BEFORE_COLLECTIVE)


def library_seconds(ranks: Sequence[RankSteps]) -> tuple[float, int]:
    """The most seconds a rank spent in the library's own steps (LIBRARY_STEPS; `ranks` as split_waits
    returns them, the collective net of the wait for the last rank), and that rank: the least a case
    can take, however fast qgather's own steps get."""
    return max(((sum(r.seconds.get(step, 0.0) for step in LIBRARY_STEPS), r.rank) for r in ranks),
               key=lambda seconds_rank: (seconds_rank[0], -seconds_rank[1]))


def spreads(ranks: Sequence[RankSteps]) -> list[StepSpread]:
    """Every step any rank ran, slowest first (by its slowest rank); a rank that did not run a step
    counts 0 s for it."""
    steps = {step for r in ranks for step in r.seconds}
    out = []
    for step in steps:
        timed = sorted(((r.seconds.get(step, 0.0), r.rank) for r in ranks), key=lambda t: (t[0], t[1]))
        (fast_s, fast_rank), (slow_s, slow_rank) = timed[0], timed[-1]
        out.append(StepSpread(step, slow_s, slow_rank, fast_s, fast_rank))
    return sorted(out, key=lambda s: (-s.slowest_s, s.step))


def median_slowest(tables: Sequence[Sequence[StepSpread]]) -> list[StepSpread]:
    """Each step of several runs' tables (spreads) as it was in the run of its median slowest-rank
    seconds (a run without the step: 0 s there; of an even number, the lower middle one): what the floor
    goals judge, so that one run's stall in one step (a shared host) does not decide them."""
    steps = {s.step for table in tables for s in table}
    absent = lambda step: StepSpread(step, 0.0, -1, 0.0, -1)  # noqa: E731
    out = []
    for step in steps:
        runs = sorted((next((s for s in table if s.step == step), absent(step)) for table in tables),
                      key=lambda s: s.slowest_s)
        out.append(runs[(len(runs) - 1) // 2])
    return sorted(out, key=lambda s: (-s.slowest_s, s.step))


def floor_seconds(floor_bytes: Mapping[str, int], bandwidth: float) -> dict[str, float]:
    """Each modelled step's HBM floor in seconds; the wait before the collective is held to the
    collective's own floor (a rank that waits longer than the collective itself waits on another
    rank's work, not on the bytes)."""
    floors = {step: nbytes / bandwidth for step, nbytes in floor_bytes.items()}
    if COLLECTIVE in floors:
        floors[WAIT] = floors[COLLECTIVE]
    return floors


def _own_with_floor(table: Sequence[StepSpread], floors: Mapping[str, float]) -> list[tuple[StepSpread, float]]:
    """Each of qgather's own steps in `table` that has a floor, with that floor in seconds."""
    return [(s, floors[s.step]) for s in table if s.step in OWN_STEPS and s.step in floors]


def floor_multiples(table: Sequence[StepSpread], floors: Mapping[str, float]) -> list[tuple[str, float]]:
    """(step, multiple of its floor on its slowest rank) of each of qgather's own steps with a floor."""
    return [(s.step, s.slowest_s / floor if floor else math.inf) for s, floor in _own_with_floor(table, floors)]


def floor_misses(table: Sequence[StepSpread], floors: Mapping[str, float]) -> list[tuple[str, float, float]]:
    """(step, slowest seconds, floor seconds) of each of qgather's own steps that took more than
    FLOOR_GOAL times its floor on its slowest rank."""
    return [(s.step, s.slowest_s, floor) for s, floor in _own_with_floor(table, floors)
            if s.slowest_s > FLOOR_GOAL * floor]


def table_lines(table: Sequence[StepSpread], floors: Mapping[str, float], last_rank: int | None,
                judged: Mapping[str, float] | None = None) -> list[str]:
    """The step table: slowest and fastest rank per step, and where modelled the floor, the slowest
    rank's multiple of it and, for qgather's own steps, the goal; with `judged` (step: the seconds the
    floor goal judged, the median of the runs), that multiple too, which the goal line's verdict is of."""
    head = f"      {'step':<28} {'slowest rank':>17} {'fastest rank':>17}"
    lines = [head + ("   HBM floor  x floor" if floors else "")]
    for s in table:
        line = (f"      {s.step:<28} {s.slowest_s * 1e3:9.2f} ms (r{s.slowest_rank}) "
                f"{s.fastest_s * 1e3:9.2f} ms (r{s.fastest_rank})")
        floor = floors.get(s.step)
        if floor:
            own = f"  (goal <= {FLOOR_GOAL:g}x: qgather's own)" if s.step in OWN_STEPS else ""
            if own and judged is not None and s.step in judged:
                own = (f"  (goal <= {FLOOR_GOAL:g}x: qgather's own; judged: {judged[s.step] / floor:.1f}x, "
                       "the runs' median)")
            line += f"   {floor * 1e3:7.3f} ms {s.slowest_s / floor:7.1f}x{own}"
        lines.append(line)
    if last_rank is not None:
        lines.append(f"      (rank {last_rank} reached the collective last: the others' wait is its earlier work, "
                     f"\"{WAIT_ON_LIBRARY}\" as much of it as it spent longer in the library's steps before the "
                     f"collective ({', '.join(LIBRARY_BEFORE_COLLECTIVE)}); the collective row is what is left once it "
                     "arrived)")
    return lines
