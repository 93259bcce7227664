"""`qgather bench gpu`: what one full case costs against the bare work it wraps, in the same run,
with every goal printed as measured vs goal; exit 1 when any is missed.

    python -m qgather.tools.case_bench [--shape 8192x28672] [--formats nvfp4_2d,fp8_block] [--world-size 2]
                                 [--device cuda] [--impl te|reference] [--reps 3] [--backend nccl|gloo]
                                 [--bus-bandwidth GB/s] [--profile]

On each rank of a warm pool: the full case (golden, shard, gather, every comparison,
qgather.scenarios.registry.run_on_rank) against the bare work (the library's quantization of the
rank's shard, then the all-gather alone of as many bytes per rank as the case's collective moved),
median of `--reps` after a warm-up. Goals: the case EXACT; time within 3x of the bare work (on
NCCL: measured; with fewer GPUs than ranks, the ranks share the GPUs over gloo and the NCCL ratio
is projected, qgather.tools.nccl_projection); peak GPU memory per rank within 3x the weight's bf16
size. Then the case's steps (golden, twin, sharded module, hooks, collective, inspection ...) on
its slowest rank, each against the HBM floor of the bytes it touches. The implementation defaults
to `te` where TransformerEngine imports, else `reference`.
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
from qgather.model.verdict import Verdict
from qgather.runtime import PoolSpec, get_pool, shutdown_pools
from qgather.scenarios import context, fsdp, fsdp_setup
from qgather.scenarios.data import make_weight
from qgather.scenarios.registry import run_on_rank
from qgather.tools import memory_waypoints, peak_anatomy
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
    """Runs on every rank: the full case, then the bare work (the library's quantization of this
    rank's shard, then the all-gather alone of as many bytes as the case's collective moved), each
    timed `reps` times (with `profile`: rank 0 then runs the case once more under torch.profiler
    and returns its table)."""
    spec = CaseSpec.parse(case_id)
    cuda = ctx.device.type == "cuda"
    result = run_on_rank(ctx, spec)  # warm-up: kernels, allocator, communicators
    runs, peak = [], 0
    for _ in range(reps):  # each rep measured above what the one before left once collected
        baseline = _settle(ctx.device)
        runs.append(_timed_result(lambda: run_on_rank(ctx, spec), cuda))
        peak = max(peak, torch.cuda.max_memory_allocated(ctx.device) - baseline if cuda else 0)
    full_s, result = sorted(runs, key=lambda run: run[0])[len(runs) // 2]  # the median rep, with its steps
    nbytes = max(int(result.wire.collective_bytes), 1)
    weight = make_weight(spec, ctx.device).to(spec.torch_dtype)
    quantize_s, collective_s, own = _bare_work(ctx, spec, weight, nbytes, reps)
    table = _profiled(ctx, case_id) if profile else ""
    return {"full_s": full_s, "steps": dict(result.seconds), "quantize_s": quantize_s, "collective_s": collective_s,
            "own_quantizer": own, "peak_bytes": peak, "weight_bytes": weight.numel() * weight.element_size(),
            "weight_bf16_bytes": weight.numel() * 2, "collective_bytes": nbytes, "result": result, "profile": table,
            "device_name": torch.cuda.get_device_name(ctx.device) if cuda else "cpu"}


def _bare_work(ctx, spec: CaseSpec, weight: torch.Tensor, nbytes: int, reps: int) -> tuple[float, float, bool]:
    """(the library's quantization of this rank's shard, the all-gather alone of `nbytes` per rank),
    median seconds of each, and whether the library quantized with its own quantizer."""
    cuda = ctx.device.type == "cuda"
    shard = fsdp_setup.prepare(ctx, spec).master_slice(weight).contiguous()
    impl, fmt = get_impl(spec.impl), FORMATS[spec.fmt]
    own = impl.own_quantization(fmt.name, shard) is not None
    # without a quantizer of its own, the harness's formats are the library's
    quantize_shard = (lambda: impl.own_quantization(fmt.name, shard)) if own else (lambda: fmt.quantize(shard))
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    out = src.new_empty(nbytes * ctx.world_size)
    return (_median_of(quantize_shard, reps, cuda),
            _median_of(lambda: _all_gather(out, src, group=ctx.group), reps, cuda), own)


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
    found = classify_results([r["result"] for r in results])
    print(f"  {fmt}: {case_id}: {found.verdict.value}" + (f" ({found.reason})" if found.reason else ""))
    goals = [Goal("verdict", found.verdict is Verdict.EXACT, found.verdict.value, "EXACT")]
    slow = max(results, key=lambda r: r["full_s"])
    bare_s = slow["quantize_s"] + slow["collective_s"]
    ratio = slow["full_s"] / bare_s if bare_s else float("inf")
    timing = (f"full case {slow['full_s']:.4f} s vs bare {bare_s:.4f} s (shard quantization "
              f"{slow['quantize_s'] * 1e3:.2f} ms + all-gather alone {slow['collective_s'] * 1e3:.2f} ms over "
              f"{backend}): ratio {ratio:.2f}")
    projection = project(slow["full_s"], slow["quantize_s"], slow["collective_s"], slow["collective_bytes"],
                         args.world_size, args.bus_bandwidth * 1e9)
    if backend == "nccl":
        goals.append(Goal("time", ratio <= TIME_GOAL, timing, f"ratio <= {TIME_GOAL:g}"))
    else:
        print(f"    time on {backend} (not a goal: its all-gather goes through the host): {timing}")
        goals.append(Goal("time on NCCL (projected)", projection.ratio <= TIME_GOAL, _projection_line(projection,
                          slow, args), f"ratio <= {TIME_GOAL:g}"))
    if args.device == "cuda":
        memory = max(r["peak_bytes"] / r["weight_bf16_bytes"] for r in results)
        goals.append(Goal("memory", memory <= MEMORY_GOAL, f"peak {memory:.2f}x the bf16 weight per rank",
                          f"<= {MEMORY_GOAL:g}x"))
    for goal in goals:
        print(f"    {goal.line()}")
    _print_steps(slow, args.world_size, args.device == "cuda")
    return [f"{fmt} {goal.name}" for goal in goals if not goal.met]


@dataclass(frozen=True)
class Goal:
    name: str
    met: bool
    measured: str
    wanted: str

    def line(self) -> str:
        return f"{'ok    ' if self.met else 'MISSED'} {self.name}: {self.measured} (goal: {self.wanted})"


def _projection_line(p: Projection, slow: dict, args: argparse.Namespace) -> str:
    megabytes = slow["collective_bytes"] * args.world_size / 1e6
    return (f"case {p.case_on_nccl_s * 1e3:.2f} ms vs bare {p.bare_on_nccl_s * 1e3:.3f} ms: ratio {p.ratio:.1f} "
            f"[the measured all-gather ({p.measured_collective_s * 1e3:.1f} ms) replaced by NCCL's "
            f"{p.nccl_collective_s * 1e3:.3f} ms for {megabytes:.0f} MB at {args.bus_bandwidth:g} GB/s bus "
            f"bandwidth: {BUS_BANDWIDTH_SOURCE}]")


def _print_steps(slow: dict, world_size: int, on_gpu: bool) -> None:
    """The case's steps on its slowest rank (median rep): seconds, and on a GPU the HBM floor where modelled."""
    bandwidth, source = hbm_bandwidth(slow["device_name"])
    quantized = slow["collective_bytes"] * world_size
    floors = step_floor_bytes(slow["weight_bytes"], quantized, world_size, slow["own_quantizer"]) if on_gpu else {}
    print(f"    steps (rank {slow['result'].rank}, the median rep" + (
        f"; HBM floor: the bytes a step must read and write at least, a model, at {source}):" if on_gpu else "):"))
    for step, seconds in sorted(slow["steps"].items(), key=lambda kv: -kv[1]):
        floor = floors.get(step)
        extra = "" if floor is None else (f"   {floor / 1e6:8.0f} MB -> floor {floor / bandwidth * 1e3:7.3f} ms, "
                                          f"{seconds / (floor / bandwidth):6.1f}x the floor")
        print(f"      {step:<24} {seconds * 1e3:9.2f} ms{extra}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
