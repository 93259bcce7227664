"""Where one benchmarked case's time and memory go (`qgather bench gpu --profile`), on rank 0 of the
pool while the other ranks run the case along: torch.profiler's operators, each step function's
host and device time (a profiler range per step), cProfile's Python functions, and the peak memory
of every step with what is allocated at the peak, for a run that computes the golden and for one
that finds it kept. The measuring itself is qgather.tools.bench.case_bench's.
"""

from __future__ import annotations

import cProfile
import functools
import io
import math
import pstats

from torch.distributed.fsdp import FSDPModule
from torch.profiler import ProfilerActivity, profile, record_function

from qgather.check import golden, golden_cache, inspection
from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.instruments import fused
from qgather.model.case import CaseSpec
from qgather.scenarios import context, fsdp
from qgather.scenarios.registry import run_on_rank
from qgather.tools.bench import memory_waypoints, peak_anatomy

PROFILE_ROWS = 30


def profiled(ctx, case_id: str) -> str:
    """Where one case's time goes: torch.profiler's operators (device and host time), then the
    Python functions by cumulative time (cProfile), on rank 0; the other ranks run the case along."""
    spec = CaseSpec.parse(case_id)
    cuda = ctx.device.type == "cuda"
    if cuda:  # the memory steps of a run that computes the golden, as the warm-up run did
        golden_cache.forget(ctx.kept)
    if ctx.rank != 0:  # runs along: twice for the memory steps (on CUDA), once under the profiler
        for _ in range(3 if cuda else 1):
            run_on_rank(ctx, spec)
        return ""
    steps = ""
    if cuda:
        steps = ("  a run that computes the golden (as the warm-up run):\n" + _memory_steps(ctx, case_id)
                 + "\n  a run that finds it kept (as the measured runs):\n" + _memory_steps(ctx, case_id))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    python = cProfile.Profile()
    with profile(activities=activities, profile_memory=True) as prof, _ranges(_step_targets(spec)):
        python.enable()
        run_on_rank(ctx, spec)
        python.disable()
    sort = "cuda_time_total" if ctx.device.type == "cuda" else "cpu_time_total"
    out = io.StringIO()
    pstats.Stats(python, stream=out).sort_stats("cumulative").print_stats(PROFILE_ROWS)
    memory = "self_cuda_memory_usage" if ctx.device.type == "cuda" else "self_cpu_memory_usage"
    averages = prof.key_averages()
    return "\n".join((steps, _range_table(averages), averages.table(sort_by=sort, row_limit=PROFILE_ROWS),
                      averages.table(sort_by=memory, row_limit=PROFILE_ROWS), out.getvalue()))


RANGE = "qgather: "  # the profiler ranges of `_ranges`


def _ranges(targets: list[tuple[object, str]]):
    """Each target ((owner, attribute name)) runs inside a profiler range of its own name while the
    block runs, so that the profile says the host and the device time of each step."""
    return memory_waypoints.wrapping(targets, _in_range)


def _in_range(label: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with record_function(RANGE + label):
            return fn(*args, **kwargs)

    return call


def _range_table(averages) -> str:
    """Host and device milliseconds of each step's range (nested ones included in their callers')."""
    rows = sorted((e for e in averages if e.key.startswith(RANGE)), key=lambda e: -e.cpu_time_total)
    lines = [f"  {'step (profiler range)':<60} {'host ms':>9} {'device ms':>10} {'calls':>6}"]
    for e in rows:
        device = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        lines.append(f"  {e.key[len(RANGE):]:<60} {e.cpu_time_total / 1e3:9.2f} {device / 1e3:10.2f} {e.count:6d}")
    return "\n".join(lines)


def _memory_steps(ctx, case_id: str) -> str:
    """The case once more with the peak device memory of each of its steps recorded."""
    spec = CaseSpec.parse(case_id)
    baseline = memory_waypoints.settle(ctx.device)
    with peak_anatomy.recorded(ctx.device) as found, \
            memory_waypoints.recording(ctx.device, _step_targets(spec), baseline) as points:
        run_on_rank(ctx, spec)
    unit = math.prod(spec.shape) * 2
    return points.table(unit, "bf16 weights") + "\n" + found[0].table(unit, "bf16 weights")


def _step_targets(spec: CaseSpec) -> list[tuple[object, str]]:
    """The functions of a case's steps, where the case looks each up (a module's global, or a method
    of the inspection, the format or the implementation)."""
    impl_type, fmt_type = type(get_impl(spec.impl)), type(FORMATS[spec.fmt])
    targets = [(fsdp, n) for n in ("make_weight", "build_sharded_module")] + [(context, "golden_for")]
    targets += [(inspection.Inspector, n) for n in ("twin_output", "judge", "module_check", "_launch_forward",
                                                    "_evidence")]
    targets += [(inspection, n) for n in ("launch_buffers", "launch_value_blocks", "launch_values", "read_together",
                                          "compare_values", "compare_value_blocks", "digest", "_golden_output")]
    targets += [(golden, "compare_buffers")] + [(fused, n) for n in ("count_differing", "count_differing_values")]
    targets += [(fmt_type, n) for n in ("quantize", "dequantize", "dequantize_rows")] + [(FSDPModule, "unshard")]
    targets += [(impl_type, n) for n in ("own_quantization", "own_quantization_parts", "own_dequantize",
                                         "own_dequantize_blocks", "forward", "forward_rows", "forward_own_rows",
                                         "read_buffers",
                                         "single_device_output", "module_output", "make_sharded_module")
                if hasattr(impl_type, n)]
    return targets
