"""`qgather bench gpu`: what one full case costs against the bare work it wraps, in the same run.

    python -m qgather.tools.case_bench [--shape 8192x28672] [--formats nvfp4_2d,fp8_block] [--world-size 2]
                                 [--device cuda] [--impl te|reference] [--reps 3]

On each rank of a warm pool (NCCL on GPUs): the full case (golden, shard, gather, every comparison,
qgather.scenarios.registry.run_on_rank) against the bare work (the reference quantization of the full
weight plus one all-gather of as many bytes per rank as the case's collective moved), median of
`--reps` after a warm-up. Prints per format the time ratio (goal <= 3) and the peak GPU memory per
rank against the weight's bf16 size (goal <= 3x). The implementation defaults to `te` where
TransformerEngine imports, else `reference`.
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
from qgather.scenarios import fsdp
from qgather.scenarios.data import make_weight
from qgather.scenarios.registry import run_on_rank
from qgather.tools import memory_waypoints

TIME_GOAL = 3.0
MEMORY_GOAL = 3.0


def measure_on_rank(ctx, case_id: str, reps: int, profile: bool = False) -> dict:
    """Runs on every rank: the full case, then the bare work, each timed `reps` times (with
    `profile`: rank 0 then runs the case once more under torch.profiler and returns its table)."""
    spec = CaseSpec.parse(case_id)
    cuda = ctx.device.type == "cuda"
    result = run_on_rank(ctx, spec)  # warm-up: kernels, allocator, communicators
    full, peak = [], 0
    for _ in range(reps):  # each rep measured above what the one before left once collected
        baseline = _settle(ctx.device)
        full.append(_timed(lambda: run_on_rank(ctx, spec), cuda))
        peak = max(peak, torch.cuda.max_memory_allocated(ctx.device) - baseline if cuda else 0)
    nbytes = max(int(result.wire.collective_bytes), 1)
    weight = make_weight(spec, ctx.device).to(spec.torch_dtype)
    fmt = FORMATS[spec.fmt]

    def bare() -> None:
        fmt.quantize(weight)
        src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        out = src.new_empty(nbytes * ctx.world_size)
        _all_gather(out, src, group=ctx.group)

    bare()
    bare_s = [_timed(bare, cuda) for _ in range(reps)]
    table = _profiled(ctx, case_id) if profile else ""
    return {"full_s": statistics.median(full), "bare_s": statistics.median(bare_s), "peak_bytes": peak,
            "weight_bf16_bytes": weight.numel() * 2, "collective_bytes": nbytes, "result": result, "profile": table}


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
    targets = [(fsdp, n) for n in ("make_weight", "golden_for", "build_sharded_module")]
    targets += [(inspection.Inspector, n) for n in ("twin_output", "judge", "module_check")]
    targets += [(inspection, n) for n in ("compare_buffers", "compare_values", "digest")]
    targets += [(golden, "compare_buffers")]
    targets += [(fmt_type, n) for n in ("quantize", "dequantize", "dequantize_rows")] + [(FSDPModule, "unshard")]
    targets += [(impl_type, n) for n in ("own_quantization", "own_dequantize", "forward", "read_buffers",
                                         "single_device_output", "module_output", "make_sharded_module")
                if hasattr(impl_type, n)]
    baseline = _settle(ctx.device)
    with memory_waypoints.recording(ctx.device, targets, baseline) as points:
        run_on_rank(ctx, spec)
    return points.table(math.prod(spec.shape) * 2, "bf16 weights")


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
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qgather bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8192x28672")
    parser.add_argument("--formats", default="nvfp4_2d,fp8_block")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--impl", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backend", default=None, choices=("nccl", "gloo"),
                        help="default: nccl on cuda, gloo on cpu (gloo on cuda: more ranks than GPUs)")
    parser.add_argument("--profile", action="store_true", help="print where one case's time goes (rank 0)")
    parser.add_argument("--timeout", type=float, default=600.0)
    return parser.parse_args(argv)


def _default_impl(device: str) -> str:
    if device != "cuda":
        return "reference"
    return "reference" if te_import_error() else "te"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse([] if argv is None else argv)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < args.world_size:
        print(f"bench gpu: skipped: needs {args.world_size} CUDA GPUs, this host has {torch.cuda.device_count()} "
              "(for a CPU dry run: --device cpu --shape 256x512; gloo on one GPU: --backend gloo)")
        return 0
    impl = args.impl or _default_impl(args.device)
    pool = get_pool(PoolSpec(backend=backend, world_size=args.world_size, device=args.device))
    print(f"bench gpu: {impl}, {args.shape} bf16, {args.world_size} ranks over {backend} on {args.device}, "
          f"median of {args.reps}")
    worst, judged = 0.0, True
    try:
        for fmt in args.formats.split(","):
            case_id = f"{impl}:{fmt}:{args.shape}:bf16:ws{args.world_size}:gather:s0"
            outcome = pool.run(measure_on_rank, case_id, args.reps, args.profile, timeout=args.timeout)
            if outcome.status != "ok":
                print(f"  {fmt}: the case did not run: {outcome.summary()}")
                print(_traceback_tail(outcome))
                judged = False
                continue
            worst = max(worst, _print_row(fmt, outcome.results, args.device))
            if args.profile:
                print(outcome.results[0]["profile"])
            judged &= _print_verdict(case_id, outcome.results)
    finally:
        shutdown_pools()
    return 0 if worst <= TIME_GOAL and judged else 1


def _traceback_tail(outcome, lines: int = 12) -> str:
    first = next(iter(outcome.errors.values()), None)
    if first is None or not first.traceback_text:
        return ""
    return "\n".join("    " + line for line in first.traceback_text.rstrip().splitlines()[-lines:])


def _print_verdict(case_id: str, results: list[dict]) -> bool:
    """The measured case's own verdict: timings of a case that does not pass measure another path."""
    found = classify_results([r["result"] for r in results])
    verdict, reason = found.verdict, found.reason
    print(f"    {case_id}: {verdict.value}" + (f" ({reason})" if reason else ""))
    return verdict is Verdict.EXACT


def _print_row(fmt: str, results: list[dict], device: str) -> float:
    ratio = max(r["full_s"] / r["bare_s"] for r in results)
    line = (f"  {fmt}: full case {max(r['full_s'] for r in results):.3f} s, bare quantize + all-gather "
            f"{max(r['bare_s'] for r in results):.3f} s: ratio {ratio:.2f} (goal <= {TIME_GOAL:g})")
    if device == "cuda":
        memory = max(r["peak_bytes"] / r["weight_bf16_bytes"] for r in results)
        line += f"; peak GPU memory per rank {memory:.2f}x the bf16 weight (goal <= {MEMORY_GOAL:g})"
    print(line)
    return ratio


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
