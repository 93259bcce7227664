"""`qgather bench gpu`: what one full case costs against the bare work it wraps, in the same run,
with every goal printed as measured vs goal; exit 1 when any is missed.

    python -m qgather.tools.case_bench [--shape 8192x28672] [--formats nvfp4_2d,fp8_block] [--world-size 2]
                                 [--device cuda] [--impl te|reference] [--reps 3] [--backend nccl|gloo]
                                 [--bus-bandwidth GB/s] [--profile]

On each rank of a warm pool, every run started on every rank at once (a barrier, as the pool starts
a case): the full case (golden, shard, gather, every comparison, qgather.scenarios.registry.run_on_rank)
after a warm-up run, against the bare work (the library's quantization of the rank's shard, its own
sharded module build where it has a route of its own, and the all-gather alone of as many bytes per
rank as the case's collective moved), median of `--reps`. Goals: the case EXACT in every run; the
case (its slowest rank) within 3x of the bare work (on NCCL: measured; with fewer GPUs than ranks,
the ranks share the GPUs over gloo and the NCCL ratio is projected, qgather.tools.nccl_projection);
peak GPU memory per rank within 3x the weight's bf16 size over every run, warm-up included; on
NCCL, each of qgather's own steps (golden, inspection, one-device twin, the wait before the
collective) within 5x its HBM floor on its slowest rank (qgather.tools.bench_steps). Then the
case's steps, each with its slowest and its fastest rank. The implementation defaults to `te`
where TransformerEngine imports, else `reference`.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.profiler import ProfilerActivity, profile

from qgather.check import golden, inspection
from qgather.engine.classify import classify_results
from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.impls.te.environment import te_import_error
from qgather.model.case import CaseSpec
from qgather.model.phases import Step
from qgather.model.verdict import Verdict
from qgather.runtime import PoolSpec, get_pool, shutdown_pools
from qgather.scenarios import context, fsdp, fsdp_setup
from qgather.scenarios.data import make_weight
from qgather.scenarios.module import own_sharded_module
from qgather.scenarios.registry import run_on_rank
from qgather.tools import bench_steps, memory_waypoints, peak_anatomy
from qgather.tools.nccl_projection import (
    BUS_BANDWIDTH,
    BUS_BANDWIDTH_SOURCE,
    Projection,
    hbm_bandwidth,
    project,
    step_floor_bytes,
)

TIME_GOAL = 3.0
MEMORY_GOAL = 3.0


def measure_on_rank(ctx, case_id: str, reps: int, profile: bool = False) -> dict:
    """Runs on every rank: the full case `reps` + 1 times (the first a warm-up: kernels, allocator,
    communicators, and what the case keeps for the next one, e.g. a golden it computed), then the
    bare work (the library's quantization of this rank's shard, its module build where it has a
    route of its own, and the all-gather alone of as many bytes as the case's collective moved),
    each timed `reps` times. The peak memory is over every run, warm-up included, above what was
    allocated before the first one: what a run keeps for the next counts. With `profile`: rank 0
    then runs the case once more under torch.profiler and returns its table."""
    spec = CaseSpec.parse(case_id)
    cuda = ctx.device.type == "cuda"
    baseline = _settle(ctx.device)
    runs = []
    for _ in range(reps + 1):
        dist.barrier(group=ctx.group)  # every run starts on every rank at once, as the pool starts a case
        seconds, result = _timed_result(lambda: run_on_rank(ctx, spec), cuda)
        runs.append({"full_s": seconds, "result": result})
        gc.collect()  # a sharded module's reference cycles, before the next run allocates its own
    peak = torch.cuda.max_memory_allocated(ctx.device) - baseline if cuda else 0
    nbytes = max(int(runs[-1]["result"].wire.collective_bytes), 1)
    weight = make_weight(spec, ctx.device).to(spec.torch_dtype)
    bare = _bare_work(ctx, spec, weight, nbytes, reps)
    table = _profiled(ctx, case_id) if profile else ""
    return {"runs": runs, "bare": bare, "peak_bytes": peak, "weight_bytes": weight.numel() * weight.element_size(),
            "weight_bf16_bytes": weight.numel() * 2, "collective_bytes": nbytes, "profile": table,
            "device_name": torch.cuda.get_device_name(ctx.device) if cuda else "cpu"}


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


def _bare_work(ctx, spec: CaseSpec, weight: torch.Tensor, nbytes: int, reps: int) -> BareWork:
    """The library's quantization of this rank's shard, its own module build (where it has one) and
    the all-gather alone of `nbytes` per rank: median seconds of each."""
    cuda = ctx.device.type == "cuda"
    setup = fsdp_setup.prepare(ctx, spec)
    shard = setup.master_slice(weight).contiguous()
    impl, fmt = get_impl(spec.impl), FORMATS[spec.fmt]
    own = impl.own_quantization(fmt.name, shard) is not None
    # without a quantizer of its own, the harness's formats are the library's
    quantize_shard = (lambda: impl.own_quantization(fmt.name, shard)) if own else (lambda: fmt.quantize(shard))
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    out = src.new_empty(nbytes * ctx.world_size)
    return BareWork(_median_of(quantize_shard, reps, cuda),
                    _median_of(lambda: _all_gather(out, src, group=ctx.group), reps, cuda),
                    _module_build_s(ctx, spec, weight, setup, reps), own)


def _module_build_s(ctx, spec: CaseSpec, weight: torch.Tensor, setup, reps: int) -> float | None:
    """Median seconds of the library's own sharded module build from the full weight (what its users
    run: e.g. TE's modules on meta, fully_shard, reset_parameters), or None without such a route."""
    impl, cuda = get_impl(spec.impl), ctx.device.type == "cuda"
    if own_sharded_module(impl, ctx, spec, weight, setup) is None:
        return None
    times = []
    for _ in range(reps + 1):  # the first a warm-up
        gc.collect()  # the module before, held by FSDP2's reference cycles, is freed outside the clock
        times.append(_timed_result(lambda: own_sharded_module(impl, ctx, spec, weight, setup), cuda)[0])
    gc.collect()
    return statistics.median(times[1:])


def _median_of(fn, reps: int, cuda: bool) -> float:
    fn()  # warm-up
    return statistics.median(_timed(fn, cuda) for _ in range(reps))


def _timed_result(fn, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, value


PROFILE_ROWS = 30


def _profiled(ctx, case_id: str) -> str:
    """Where one case's time goes: torch.profiler's operators (device and host time), then the
    Python functions by cumulative time (cProfile), on rank 0; the other ranks run the case along."""
    spec = CaseSpec.parse(case_id)
    if ctx.rank != 0:  # runs along: once for the memory steps (on CUDA), once under the profiler
        for _ in range(2 if ctx.device.type == "cuda" else 1):
            run_on_rank(ctx, spec)
        return ""
    steps = _memory_steps(ctx, case_id) if ctx.device.type == "cuda" else ""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    python = cProfile.Profile()
    with profile(activities=activities, profile_memory=True) as prof:
        python.enable()
        run_on_rank(ctx, spec)
        python.disable()
    sort = "cuda_time_total" if ctx.device.type == "cuda" else "cpu_time_total"
    out = io.StringIO()
    pstats.Stats(python, stream=out).sort_stats("cumulative").print_stats(PROFILE_ROWS)
    memory = "self_cuda_memory_usage" if ctx.device.type == "cuda" else "self_cpu_memory_usage"
    averages = prof.key_averages()
    return "\n".join((steps, averages.table(sort_by=sort, row_limit=PROFILE_ROWS),
                      averages.table(sort_by=memory, row_limit=PROFILE_ROWS), out.getvalue()))


def _memory_steps(ctx, case_id: str) -> str:
    """The case once more with the peak device memory of each of its steps recorded."""
    spec = CaseSpec.parse(case_id)
    impl_type, fmt_type = type(get_impl(spec.impl)), type(FORMATS[spec.fmt])
    # each step where the case looks it up (a module's global, or a method of the inspection)
    targets = [(fsdp, n) for n in ("make_weight", "build_sharded_module")] + [(context, "golden_for")]
    targets += [(inspection.Inspector, n) for n in ("twin_output", "judge", "module_check")]
    targets += [(inspection, n) for n in ("compare_buffers", "compare_values", "digest")]
    targets += [(golden, "compare_buffers")]
    targets += [(fmt_type, n) for n in ("quantize", "dequantize", "dequantize_rows")] + [(FSDPModule, "unshard")]
    targets += [(impl_type, n) for n in ("own_quantization", "own_quantization_parts", "own_dequantize",
                                         "own_dequantize_blocks", "forward", "forward_rows", "read_buffers",
                                         "single_device_output", "module_output", "make_sharded_module")
                if hasattr(impl_type, n)]
    baseline = _settle(ctx.device)
    with peak_anatomy.recorded(ctx.device) as found, \
            memory_waypoints.recording(ctx.device, targets, baseline) as points:
        run_on_rank(ctx, spec)
    unit = math.prod(spec.shape) * 2
    return points.table(unit, "bf16 weights") + "\n" + found[0].table(unit, "bf16 weights")


def _settle(device: torch.device) -> int:
    """Free what earlier runs left in reference cycles (a sharded module's hooks) and start the peak
    counter; returns the bytes still allocated, which the case's peak is measured above."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; torch 2.11 (the GPU hosts) lacks the latter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _timed(fn, cuda: bool) -> float:
    return _timed_result(fn, cuda)[0]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qgather bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8192x28672")
    parser.add_argument("--formats", default="nvfp4_2d,fp8_block")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--impl", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backend", default=None, choices=("nccl", "gloo"),
                        help="default: nccl when the host has a GPU per rank, else gloo (on the GPUs it has; the "
                             "NCCL time is then projected)")
    parser.add_argument("--bus-bandwidth", type=float, default=BUS_BANDWIDTH / 1e9,
                        help=f"GB/s of NCCL all-gather bus bandwidth the projection assumes (default: "
                             f"{BUS_BANDWIDTH / 1e9:g}, {BUS_BANDWIDTH_SOURCE})")
    parser.add_argument("--profile", action="store_true", help="print where one case's time goes (rank 0)")
    parser.add_argument("--timeout", type=float, default=600.0)
    return parser.parse_args(argv)


def _default_impl(device: str) -> str:
    if device != "cuda":
        return "reference"
    return "reference" if te_import_error() else "te"


def _backend(args: argparse.Namespace) -> str:
    if args.backend:
        return args.backend
    if args.device == "cuda" and torch.cuda.device_count() >= args.world_size:
        return "nccl"
    return "gloo"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse([] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench gpu: skipped: needs a CUDA GPU (for a CPU dry run: --device cpu --shape 256x512)")
        return 0
    backend = _backend(args)
    if backend == "nccl" and torch.cuda.device_count() < args.world_size:
        print(f"bench gpu: --backend nccl needs {args.world_size} CUDA GPUs, this host has "
              f"{torch.cuda.device_count()} (without --backend, gloo runs the ranks on the GPUs there are)")
        return 4
    impl = args.impl or _default_impl(args.device)
    pool = get_pool(PoolSpec(backend=backend, world_size=args.world_size, device=args.device))
    print(f"bench gpu: {impl}, {args.shape} bf16, {args.world_size} ranks over {backend} on {args.device}, "
          f"median of {args.reps}")
    missed: list[str] = []
    try:
        for fmt in args.formats.split(","):
            case_id = f"{impl}:{fmt}:{args.shape}:bf16:ws{args.world_size}:gather:s0"
            outcome = pool.run(measure_on_rank, case_id, args.reps, args.profile, timeout=args.timeout)
            if outcome.status != "ok":
                print(f"  {fmt}: the case did not run: {outcome.summary()}")
                print(_traceback_tail(outcome))
                missed.append(f"{fmt}: did not run")
                continue
            missed += _report(fmt, case_id, outcome.results, args, backend)
            if args.profile:
                print(outcome.results[0]["profile"])
    finally:
        shutdown_pools()
    if missed:
        print(f"bench gpu: {len(missed)} goal(s) missed: " + "; ".join(missed))
        return 1
    print("bench gpu: every goal met")
    return 0


def _traceback_tail(outcome, lines: int = 12) -> str:
    first = next(iter(outcome.errors.values()), None)
    if first is None or not first.traceback_text:
        return ""
    return "\n".join("    " + line for line in first.traceback_text.rstrip().splitlines()[-lines:])


def _report(fmt: str, case_id: str, results: list[dict], args: argparse.Namespace, backend: str) -> list[str]:
    """Every goal of one format, measured vs goal, then where the case's seconds went; the goals missed."""
    goals = [_verdict_goal(fmt, case_id, results)]
    rep = _median_rep(results)
    case_s = max(r["runs"][rep]["full_s"] for r in results)  # a case takes as long as its slowest rank
    bare = max((r["bare"] for r in results), key=lambda b: b.total_s)
    first = results[0]
    nbytes = first["collective_bytes"]
    ratio = case_s / bare.total_s if bare.total_s else float("inf")
    print(f"    bare work, its slowest rank: {_bare_line(bare, case_id.split(':' + fmt + ':')[0], nbytes, backend)}")
    timing = f"case {case_s * 1e3:.2f} ms (its slowest rank) vs bare {bare.total_s * 1e3:.2f} ms: ratio {ratio:.2f}"
    if backend == "nccl":
        goals.append(Goal("time", ratio <= TIME_GOAL, timing, f"ratio <= {TIME_GOAL:g}"))
    else:
        print(f"    time on {backend} (not a goal: its all-gather goes through the host): {timing}")
        projection = project(case_s, bare.total_s - bare.collective_s, bare.collective_s, nbytes,
                             args.world_size, args.bus_bandwidth * 1e9)
        goals.append(Goal("time on NCCL (projected)", projection.ratio <= TIME_GOAL,
                          _projection_line(projection, nbytes, args), f"ratio <= {TIME_GOAL:g}"))
    if args.device == "cuda":
        memory = max(r["peak_bytes"] / r["weight_bf16_bytes"] for r in results)
        goals.append(Goal("memory", memory <= MEMORY_GOAL, f"peak {memory:.2f}x the bf16 weight per rank "
                          "(every run, warm-up included)", f"<= {MEMORY_GOAL:g}x"))
    print(f"    {_golden_line(results, rep)}")
    ranks, last_rank = bench_steps.split_waits([_rank_steps(r["runs"][rep]["result"]) for r in results])
    table = bench_steps.spreads(ranks)
    floors = _floors(first, bare.own_quantizer, args) if args.device == "cuda" else {}
    if floors and backend == "nccl":
        goals += [Goal(f"{step} within {bench_steps.FLOOR_GOAL:g}x its HBM floor", False,
                       f"{seconds * 1e3:.2f} ms on its slowest rank vs floor {floor * 1e3:.3f} ms: "
                       f"{seconds / floor:.1f}x", f"<= {bench_steps.FLOOR_GOAL:g}x")
                  for step, seconds, floor in bench_steps.floor_misses(table, floors)]
        goals.append(Goal("qgather's own steps within their HBM floors", not bench_steps.floor_misses(table, floors),
                          ", ".join(bench_steps.OWN_STEPS), f"each <= {bench_steps.FLOOR_GOAL:g}x its floor"))
    for goal in goals:
        print(f"    {goal.line()}")
    _print_steps(table, floors, last_rank, rep, hbm_bandwidth(first["device_name"])[1], backend)
    return [f"{fmt} {goal.name}" for goal in goals if not goal.met]


def _verdict_goal(fmt: str, case_id: str, results: list[dict]) -> Goal:
    """The case's verdict over the ranks in every run (warm-up included): the first one not EXACT, if any."""
    found = [classify_results([r["runs"][i]["result"] for r in results]) for i in range(len(results[0]["runs"]))]
    worst = next((f for f in found if f.verdict is not Verdict.EXACT), found[0])
    print(f"  {fmt}: {case_id}: {worst.verdict.value}" + (f" ({worst.reason})" if worst.reason else "")
          + f" ({sum(f.verdict is Verdict.EXACT for f in found)} of {len(found)} runs EXACT)")
    return Goal("verdict", worst.verdict is Verdict.EXACT, f"{worst.verdict.value} in every run" if
                worst.verdict is Verdict.EXACT else worst.verdict.value, "EXACT")


def _golden_line(results: list[dict], rep: int) -> str:
    """The golden's seconds in the warm-up run, which computed it, and in the measured run, which
    found it kept (qgather.check.golden_cache), on their slowest ranks."""
    def slowest(run: int) -> float:
        return max(dict(r["runs"][run]["result"].seconds).get(Step.GOLDEN.value, 0.0) for r in results)

    return (f"golden: {slowest(0) * 1e3:.2f} ms in the warm-up run, which computed it; {slowest(rep) * 1e3:.2f} ms "
            f"in the measured runs, which find it kept for the same weight (qgather.check.golden_cache)")


def _median_rep(results: list[dict]) -> int:
    """The measured run (the warm-up, run 0, is not one) whose slowest rank took the median time."""
    measured = range(1, len(results[0]["runs"]))
    by_time = sorted(measured, key=lambda i: max(r["runs"][i]["full_s"] for r in results))
    return by_time[len(by_time) // 2]


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

    def line(self) -> str:
        return f"{'ok    ' if self.met else 'MISSED'} {self.name}: {self.measured} (goal: {self.wanted})"


def _projection_line(p: Projection, nbytes: int, args: argparse.Namespace) -> str:
    megabytes = nbytes * args.world_size / 1e6
    return (f"case {p.case_on_nccl_s * 1e3:.2f} ms vs bare {p.bare_on_nccl_s * 1e3:.3f} ms: ratio {p.ratio:.1f} "
            f"[the measured all-gather ({p.measured_collective_s * 1e3:.1f} ms) replaced by NCCL's "
            f"{p.nccl_collective_s * 1e3:.3f} ms for {megabytes:.0f} MB at {args.bus_bandwidth:g} GB/s bus "
            f"bandwidth: {BUS_BANDWIDTH_SOURCE}]")


def _print_steps(table: list, floors: dict[str, float], last_rank: int | None, rep: int,
                 bandwidth_source: str, backend: str) -> None:
    """The case's steps over its ranks (the median run): the slowest and the fastest rank, and on a GPU
    the HBM floor where modelled."""
    if not floors:
        where = "no HBM floors on the CPU"
    else:
        where = f"HBM floor: the bytes a step must read and write at least, a model, at {bandwidth_source}"
        if backend != "nccl":
            where += f"; not goals: the ranks share GPUs over {backend}"
    print(f"    steps (run {rep}, the median; {where}):")
    for line in bench_steps.table_lines(table, floors, last_rank):
        print(line)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
