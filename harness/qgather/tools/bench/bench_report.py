"""What `qgather bench gpu` prints of a measured case and which goals it missed: the bare work part by
part, the goals measured against their limits, and each step's slowest and fastest rank against its
HBM floor (qgather.tools.bench.bench_steps). The measuring is qgather.tools.bench.case_bench's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from qgather.engine.classify import classify_results
from qgather.model.phases import Step
from qgather.model.verdict import Verdict
from qgather.tools.bench import bench_steps
from qgather.tools.bench.nccl_projection import (
    BUS_BANDWIDTH_SOURCE,
    Projection,
    RankRun,
    hbm_bandwidth,
    project,
    step_floor_bytes,
)

TIME_GOAL = 3.0
MEMORY_GOAL = 3.0


@dataclass(frozen=True)
class BareWork:
    """The bare work on one rank, median seconds of each part; `build_s` None: the library has no
    module build of its own (qgather's fully_shard route builds the module)."""

    quantize_s: float
    collective_s: float
    build_s: float | None
    own_quantizer: bool

    @property
    def total_s(self) -> float:
        return self.quantize_s + self.collective_s + (self.build_s or 0.0)


def report(fmt: str, case_id: str, results: list[dict], args: argparse.Namespace, backend: str) -> list[str]:
    """Every goal of one format, measured vs goal, then where the case's seconds went; the goals missed."""
    goals = [_verdict_goal(fmt, case_id, results)]
    rep = _median_rep(results)
    case_s = max(r["runs"][rep]["full_s"] for r in results)  # a case takes as long as its slowest rank
    bare = max((r["bare"] for r in results), key=lambda b: b.total_s)
    first = results[0]
    nbytes = first["collective_bytes"]
    ratio = case_s / bare.total_s if bare.total_s else float("inf")
    print(f"    bare work, its slowest rank: {_bare_line(bare, case_id.split(':' + fmt + ':')[0], nbytes, backend)}")
    ranks, last_rank = _split_run(results, rep)
    timing = f"case {case_s * 1e3:.2f} ms (its slowest rank) vs bare {bare.total_s * 1e3:.2f} ms: ratio {ratio:.2f}"
    if backend == "nccl":
        goals.append(Goal("time", ratio <= TIME_GOAL, timing, f"ratio <= {TIME_GOAL:g}"))
        print(f"    {_library_line(ranks, bare.total_s)}")
    else:
        print(f"    time on {backend} (not a goal: its all-gather goes through the host): {timing}")
        projection = project(_rank_runs(results, ranks, rep), bare.total_s - bare.collective_s, nbytes,
                             args.world_size, args.bus_bandwidth * 1e9)
        goals.append(Goal("time on NCCL (projected)", projection.ratio <= TIME_GOAL,
                          _projection_line(projection, nbytes, args), f"ratio <= {TIME_GOAL:g}"))
    if args.device == "cuda":
        runs = len(results[0]["runs"])
        memory, warm_up = _peak(results, range(runs)), _peak(results, range(1))
        measured = _peak(results, range(1, runs))
        goals.append(Goal("memory", memory <= MEMORY_GOAL, f"peak {memory:.2f}x the bf16 weight per rank, "
                          f"{_margin(results, range(runs))} (every run, warm-up included: the warm-up run "
                          f"{warm_up:.2f}x, the measured runs {measured:.2f}x)",
                          f"<= {MEMORY_GOAL:g}x", _peak_where(results, range(runs))))
    print(f"    {_golden_line(results, rep)}")
    table = bench_steps.spreads(ranks)
    floors = _floors(first, bare.own_quantizer, args) if args.device == "cuda" else {}
    if floors and backend == "nccl":
        judged = bench_steps.median_slowest([bench_steps.spreads(_split_run(results, i)[0])
                                             for i in range(1, len(first["runs"]))])
        misses = bench_steps.floor_misses(judged, floors)
        goals += [Goal(f"{step} within {bench_steps.FLOOR_GOAL:g}x its HBM floor", False,
                       f"{seconds * 1e3:.2f} ms on its slowest rank (the median of the measured runs) vs floor "
                       f"{floor * 1e3:.3f} ms: {seconds / floor:.1f}x", f"<= {bench_steps.FLOOR_GOAL:g}x")
                  for step, seconds, floor in misses]
        multiples = ", ".join(f"{step} {multiple:.1f}x" for step, multiple in
                              sorted(bench_steps.floor_multiples(judged, floors)))
        goals.append(Goal("qgather's own steps within their HBM floors", not misses,
                          f"{multiples} (each the median of the measured runs)",
                          f"each <= {bench_steps.FLOOR_GOAL:g}x its floor"))
        judged_seconds = {s.step: s.slowest_s for s in judged}
    else:
        judged_seconds = None
    for goal in goals:
        print(f"    {goal.line()}")
    _print_steps(table, floors, last_rank, rep, hbm_bandwidth(first["device_name"])[1], backend, judged_seconds)
    return [f"{fmt} {goal.name}" for goal in goals if not goal.met]


def _verdict_goal(fmt: str, case_id: str, results: list[dict]) -> Goal:
    """The case's verdict over the ranks in every run (warm-up included): the first one not EXACT, if any."""
    found = [classify_results([r["runs"][i]["result"] for r in results]) for i in range(len(results[0]["runs"]))]
    worst = next((f for f in found if f.verdict is not Verdict.EXACT), found[0])
    print(f"  {fmt}: {case_id}: {worst.verdict.value}" + (f" ({worst.reason})" if worst.reason else "")
          + f" ({sum(f.verdict is Verdict.EXACT for f in found)} of {len(found)} runs EXACT)")
    return Goal("verdict", worst.verdict is Verdict.EXACT, f"{worst.verdict.value} in every run" if
                worst.verdict is Verdict.EXACT else worst.verdict.value, "EXACT")


def _library_line(ranks: list[bench_steps.RankSteps], bare_s: float) -> str:
    """The library's own steps alone in the median run, on the rank that spent the most in them,
    against the bare work: the ratio the case would have were qgather's own steps free."""
    seconds, rank = bench_steps.library_seconds(ranks)
    ratio = seconds / bare_s if bare_s else float("inf")
    return (f"the library's own steps alone ({', '.join(bench_steps.LIBRARY_STEPS)}): {seconds * 1e3:.2f} ms on "
            f"rank {rank}, ratio {ratio:.2f} to the bare work: the least the case can take were qgather's own "
            "steps free")


def _golden_line(results: list[dict], rep: int) -> str:
    """The golden's seconds in the warm-up run, which computed it, and in the measured run, which
    found it kept (qgather.check.golden_cache), on their slowest ranks."""
    def slowest(run: int) -> float:
        return max(dict(r["runs"][run]["result"].seconds).get(Step.GOLDEN.value, 0.0) for r in results)

    return (f"golden: {slowest(0) * 1e3:.2f} ms in the warm-up run, which computed it; {slowest(rep) * 1e3:.2f} ms "
            f"in the measured runs, which find it kept for the same weight (qgather.check.golden_cache)")


def _peak(results: list[dict], runs: range) -> float:
    """The highest peak of the runs `runs` over the ranks, in bf16 weights (the warm-up, run 0,
    computes what later runs find kept)."""
    return max(r["runs"][i]["peak_bytes"] / r["weight_bf16_bytes"] for r in results for i in runs)


def _margin(results: list[dict], runs: range) -> str:
    """The highest peak of the runs `runs` against the goal's bytes on its rank, in MB: two decimals of
    bf16 weights round a peak a few MB over the goal (e.g. 3.004x of a 470 MB weight) to the goal itself."""
    r, run = _highest(results, runs)
    goal = MEMORY_GOAL * r["weight_bf16_bytes"]
    over = run["peak_bytes"] - goal
    return f"{abs(over) / 1e6:.1f} MB {'over' if over > 0 else 'within'} the goal's {goal / 1e6:.1f} MB"


def _highest(results: list[dict], runs: range) -> tuple[dict, dict]:
    """(the rank's record, its run) of the highest peak of the runs `runs`, in bf16 weights."""
    return max(((r, r["runs"][i]) for r in results for i in runs),
               key=lambda pair: pair[1]["peak_bytes"] / pair[0]["weight_bf16_bytes"])


def _peak_where(results: list[dict], runs: range) -> str:
    """Where the highest peak of the runs `runs` was reached: its step and rank ("" when the runs name
    no step, e.g. on the CPU)."""
    _, run = _highest(results, runs)
    step = run.get("peak_step")
    return f'reached in the step "{step}" (rank {run["result"].rank})' if step else ""


def _median_rep(results: list[dict]) -> int:
    """The measured run (the warm-up, run 0, is not one) whose slowest rank took the median time."""
    measured = range(1, len(results[0]["runs"]))
    by_time = sorted(measured, key=lambda i: max(r["runs"][i]["full_s"] for r in results))
    return by_time[len(by_time) // 2]


def _rank_runs(results: list[dict], split: list[bench_steps.RankSteps], rep: int) -> list[RankRun]:
    """Each rank's run `rep` and its own collective in it (`split`: its steps with the wait for the last
    rank split out, bench_steps.split_waits; the wait stays in the run: on NCCL the ranks would wait for
    each other's work as well)."""
    return [RankRun(steps.rank, r["runs"][rep]["full_s"], steps.seconds.get(bench_steps.COLLECTIVE, 0.0))
            for r, steps in zip(results, split, strict=True)]


def _split_run(results: list[dict], run: int) -> tuple[list[bench_steps.RankSteps], int | None]:
    """Run `run`'s steps on each rank, its wait for the last rank split out (bench_steps.split_waits)."""
    return bench_steps.split_waits([_rank_steps(r["runs"][run]["result"]) for r in results])


def _rank_steps(result) -> bench_steps.RankSteps:
    return bench_steps.RankSteps(result.rank, dict(result.seconds), dict(result.started))


def _bare_line(bare: BareWork, impl: str, nbytes: int, backend: str) -> str:
    """What the bare work includes, part by part."""
    quantizer = "its own quantizer" if bare.own_quantizer else "qgather's reference formats: it has no quantizer"
    build = (f"{impl}'s own sharded module build (make_sharded_module, what its users run) "
             f"{bare.build_s * 1e3:.2f} ms" if bare.build_s is not None else
             f"no module build ({impl} has no route of its own: qgather's fully_shard route is not bare work)")
    return (f"{bare.total_s * 1e3:.2f} ms = {impl}'s quantization of the shard ({quantizer}) "
            f"{bare.quantize_s * 1e3:.2f} ms + {build} + the all-gather alone of {nbytes / 1e6:.1f} MB per rank over "
            f"{backend} {bare.collective_s * 1e3:.2f} ms")


def _floors(first: dict, own_quantizer: bool, args: argparse.Namespace) -> dict[str, float]:
    bandwidth, _ = hbm_bandwidth(first["device_name"])
    floor_bytes = step_floor_bytes(first["weight_bytes"], first["collective_bytes"] * args.world_size,
                                   args.world_size, own_quantizer)
    return bench_steps.floor_seconds(floor_bytes, bandwidth)


@dataclass(frozen=True)
class Goal:
    name: str
    met: bool
    measured: str
    wanted: str
    where: str = ""  # what the measurement points at, after the goal (e.g. the step of a memory peak)

    def line(self) -> str:
        where = f"; {self.where}" if self.where else ""
        return f"{'ok    ' if self.met else 'MISSED'} {self.name}: {self.measured} (goal: {self.wanted}){where}"


def _projection_line(p: Projection, nbytes: int, args: argparse.Namespace) -> str:
    megabytes = nbytes * args.world_size / 1e6
    return (f"case {p.case_on_nccl_s * 1e3:.2f} ms vs bare {p.bare_on_nccl_s * 1e3:.3f} ms: ratio {p.ratio:.1f} "
            f"[the case's own all-gather in the same run ({p.measured_collective_s * 1e3:.1f} ms on rank {p.rank}, "
            f"its slowest once projected) replaced by NCCL's "
            f"{p.nccl_collective_s * 1e3:.3f} ms for {megabytes:.0f} MB at {args.bus_bandwidth:g} GB/s bus "
            f"bandwidth: {BUS_BANDWIDTH_SOURCE}"
            + ("; the ranks shared the GPUs, so their other steps' device work contended, which one GPU per "
               "rank would not: the projected case errs slow]" if args.device == "cuda" else "]"))


def _print_steps(table: list, floors: dict[str, float], last_rank: int | None, rep: int,
                 bandwidth_source: str, backend: str, judged: dict[str, float] | None = None) -> None:
    """The case's steps over its ranks (the median run): the slowest and the fastest rank, and on a GPU
    the HBM floor where modelled."""
    if not floors:
        where = "no HBM floors on the CPU"
    else:
        where = f"HBM floor: the bytes a step must read and write at least, a model, at {bandwidth_source}"
        if backend != "nccl":
            where += f"; not goals: the ranks share GPUs over {backend}"
    print(f"    steps (run {rep}, the median; {where}):")
    for line in bench_steps.table_lines(table, floors, last_rank, judged):
        print(line)

