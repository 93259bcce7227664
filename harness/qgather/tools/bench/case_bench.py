"""`qgather bench gpu`: what one full case costs against the bare work it wraps, in the same run,
with every goal printed as measured vs goal; exit 1 when any is missed.

    python -m qgather.tools.bench.case_bench [--shape 8192x28672] [--formats nvfp4_2d,fp8_block] [--world-size 2]
                                 [--device cuda] [--impl te|reference] [--reps 3] [--backend nccl|gloo]
                                 [--bus-bandwidth GB/s] [--profile]

On each rank of a warm pool, every run started on every rank at once (a barrier, as the pool starts
a case): the full case (golden, shard, gather, every comparison, qgather.scenarios.registry.run_on_rank)
after a warm-up run, against the bare work (the library's quantization of the rank's shard, its own
sharded module build where it has a route of its own, and the all-gather alone of as many bytes per
rank as the case's collective moved), median of `--reps`. Goals: the case EXACT in every run; the
case (its slowest rank) within 3x of the bare work (on NCCL: measured; with fewer GPUs than ranks,
the ranks share the GPUs over gloo and the NCCL ratio is projected, qgather.tools.bench.nccl_projection);
peak GPU memory per rank within 3x the weight's bf16 size over every run, warm-up included, and the
step (and rank) in which the highest run reached it (qgather.model.phases.PhaseTracker.high_water); on
NCCL, each of qgather's own steps (golden, inspection, one-device twin, the wait before the
collective) within 5x its HBM floor on its slowest rank (qgather.tools.bench.bench_steps). Then the
case's steps, each with its slowest and its fastest rank. The implementation defaults to `te`
where TransformerEngine imports, else `reference`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.impls.te.environment import te_import_error
from qgather.model.case import CaseSpec
from qgather.runtime import PoolSpec, get_pool, shutdown_pools
from qgather.scenarios import fsdp_setup
from qgather.scenarios.data import make_weight
from qgather.scenarios.module import own_sharded_module
from qgather.scenarios.registry import run_on_rank
from qgather.tools.bench import case_profile, memory_waypoints
from qgather.tools.bench.bench_report import BareWork, report
from qgather.tools.bench.nccl_projection import (
    BUS_BANDWIDTH,
    BUS_BANDWIDTH_SOURCE,
)


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
    runs = measured_runs(ctx, spec, reps)
    nbytes = max(int(runs[-1]["result"].wire.collective_bytes), 1)
    weight = make_weight(spec, ctx.device).to(spec.torch_dtype)
    bare = _bare_work(ctx, spec, weight, nbytes, reps)
    table = case_profile.profiled(ctx, case_id) if profile else ""
    return {"runs": runs, "bare": bare, "weight_bytes": weight.numel() * weight.element_size(),
            "weight_bf16_bytes": weight.numel() * 2, "collective_bytes": nbytes, "profile": table,
            "device_name": torch.cuda.get_device_name(ctx.device) if cuda else "cpu"}


def measured_runs(ctx, spec: CaseSpec, reps: int) -> list[dict]:
    """The full case `reps` + 1 times on this rank (the first a warm-up), each started on every rank at
    once: its seconds, result, peak memory above what was allocated before the first run, and the step
    of that peak."""
    cuda = ctx.device.type == "cuda"
    baseline = memory_waypoints.settle(ctx.device)
    runs = []
    for _ in range(reps + 1):
        dist.barrier(group=ctx.group)  # every run starts on every rank at once, as the pool starts a case
        if cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        seconds, result = _timed_result(lambda: run_on_rank(ctx, spec), cuda)
        run_peak = torch.cuda.max_memory_allocated(ctx.device) - baseline if cuda else 0
        runs.append({"full_s": seconds, "result": result, "peak_bytes": run_peak, "peak_step": _peak_step(result)})
        gc.collect()  # a sharded module's reference cycles, before the next run allocates its own
    return runs


def _peak_step(result) -> str | None:
    """The step in which the run's device memory peaked (None without readings, e.g. on the CPU)."""
    if not result.high_water:
        return None
    return max(result.high_water, key=lambda step_bytes: step_bytes[1])[0]


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
            missed += report(fmt, case_id, outcome.results, args, backend)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
