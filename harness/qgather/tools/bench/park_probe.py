"""A GPU probe, not a gate: what letting a kept golden wait on the host during the first unshard would
save of a benchmarked case's peak memory, and what it would cost in time.

    python -m qgather.tools.bench.park_probe [--case te:fp8_block:8192x28672:bf16:ws2:gather:s0] [--reps 3]

fp8_block's peak on 2 x H200 (`qgather bench gpu`) is reached in FSDP2's lazy initialization inside
the first unshard: TE dequantizes the rank's shard for FSDP2's flat view (2 bf16 weights of float32
temporaries, docs/findings.md "te-fp8-block-flat-view-copy") beside TE's shard (0.5) and the golden
qgather keeps on the device (0.5, qgather.check.golden_cache), plus the scales and a few small tensors:
a few MB over 3x. Each mode runs the case as `bench gpu` does (a warm-up, then `--reps` measured runs,
the peak over all of them above what was allocated before; the golden computed afresh in each mode's
warm-up):

  kept       today's flow: the golden stays on the device
  after      its rowwise bytes go to pinned host memory (a copy made once) before `module.unshard()`
             and come back right after it, on the case's stream
  overlap    the same, but they come back on a copy stream of their own, launched from TE's pre-all-gather
             hook (after the lazy initialization's temporaries are freed), so the copy runs beside the
             collective; the case's stream waits for the copy once the unshard returns

It prints each mode's verdict, peak (in bf16 weights and MB against 3x) and the slowest rank's median
run. The patches are this probe's, for its own runs only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import sys
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from qgather.check import golden_cache
from qgather.check.golden import _same_view
from qgather.engine.classify import classify_results
from qgather.instruments import patches
from qgather.model.case import CaseSpec
from qgather.runtime import PoolSpec, get_pool, shutdown_pools
from qgather.scenarios.module import local_shard
from qgather.scenarios.registry import run_on_rank
from qgather.tools.bench import memory_waypoints

MODES = ("kept", "after", "overlap")


def probe_on_rank(ctx, case_id: str, reps: int, mode: str) -> dict:
    """Runs on every rank: the case `reps` + 1 times under `mode`; each run's seconds, peak and result."""
    spec = CaseSpec.parse(case_id)
    golden_cache.forget(ctx.kept)  # every mode computes its golden in its own warm-up, as `bench gpu` does
    baseline = memory_waypoints.settle(ctx.device)
    runs = []
    with _parked_during_unshard(ctx, mode):
        for _ in range(reps + 1):
            dist.barrier(group=ctx.group)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            torch.cuda.synchronize(ctx.device)
            start = time.perf_counter()
            result = run_on_rank(ctx, spec)
            torch.cuda.synchronize(ctx.device)
            runs.append((time.perf_counter() - start, torch.cuda.max_memory_allocated(ctx.device) - baseline, result))
            gc.collect()
    weight_bf16 = spec.shape[0] * spec.shape[1] * 2
    return {"runs": runs, "weight_bf16_bytes": weight_bf16}


@contextlib.contextmanager
def _parked_during_unshard(ctx, mode: str) -> Iterator[None]:
    if mode == "kept":
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.unshard
    host: dict[int, torch.Tensor] = {}  # id(golden) -> its rowwise bytes in pinned memory, copied once
    side = torch.cuda.Stream(ctx.device)  # one for every run: its pool keeps the block the copies reuse

    def unshard(self, *args, **kwargs):
        goldens = [g for g in golden_cache.kept_in(ctx.kept)._goldens.values()
                   if g.q is not None and g.q.buffers.get("rowwise_data", torch.empty(0)).is_cuda]
        for golden in goldens:
            rows = golden.q.buffers["rowwise_data"]
            if id(golden) not in host:
                host[id(golden)] = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows)
            _hold(golden, host[id(golden)])  # the device copy is let go (views of it too)
        if mode == "after":
            try:
                return original(self, *args, **kwargs)
            finally:
                for golden in goldens:
                    _hold(golden, host[id(golden)].to(ctx.device, non_blocking=True))
        arrived: list[torch.Tensor] = []

        def come_back() -> None:
            if not arrived:
                with torch.cuda.stream(side):  # allocated in the copy stream's own pool: no wait on the case's
                    arrived.extend(host[id(g)].to(ctx.device, non_blocking=True) for g in goldens)

        def wrap(hook):
            @functools.wraps(hook)  # FSDP2 inspects the hook's signature
            def pre_all_gather(*a, **k):
                come_back()  # the lazy initialization's temporaries are freed by now
                return hook(*a, **k)

            return pre_all_gather

        try:
            with patches._hooks_wrapped((type(local_shard(self)),), "fsdp_pre_all_gather", wrap):
                return original(self, *args, **kwargs)
        finally:
            come_back()  # where no pre-hook ran
            main = torch.cuda.current_stream(ctx.device)
            main.wait_stream(side)
            for golden, rows in zip(goldens, arrived, strict=True):
                rows.record_stream(main)
                _hold(golden, rows)

    FSDPModule.unshard = unshard
    try:
        yield
    finally:
        FSDPModule.unshard = original


def _hold(golden, rows: torch.Tensor) -> None:
    """The golden's rowwise bytes are `rows` from now on, and each buffer held as a view of them
    (Golden.keep_on_device: fp8_block's columnwise bytes) a view of `rows`; every other buffer stays."""
    views = golden.fmt.derived_views(golden.q)
    derived = [name for name, view in views.items() if _same_view(golden.q.buffers[name], view)]
    golden._hold("rowwise_data", rows)
    views = golden.fmt.derived_views(golden.q)
    for name in derived:
        golden._hold(name, views[name])


def _summary(mode: str, results: list[dict]) -> str:
    runs = len(results[0]["runs"])
    verdicts = [classify_results([r["runs"][i][2] for r in results]).verdict.value for i in range(runs)]
    peak, bf16 = max(run[1] for r in results for run in r["runs"]), results[0]["weight_bf16_bytes"]
    median = statistics.median(max(r["runs"][i][0] for r in results) for i in range(1, runs))
    over = peak - 3 * bf16
    margin = f"{abs(over) / 1e6:.1f} MB {'over' if over > 0 else 'within'} 3x"
    return (f"  {mode:8s} verdicts {','.join(verdicts)}; peak {peak / bf16:.4f}x the bf16 weight ({margin}); "
            f"case {median * 1e3:.2f} ms (median of the slowest rank)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="park_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="te:fp8_block:8192x28672:bf16:ws2:gather:s0")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("park_probe: skipped: needs CUDA GPUs")
        return 0
    spec = CaseSpec.parse(args.case)
    pool = get_pool(PoolSpec(backend="nccl", world_size=spec.world_size, device="cuda"))
    try:
        for mode in args.modes.split(","):
            outcome = pool.run(probe_on_rank, args.case, args.reps, mode, timeout=600.0)
            print(_summary(mode, outcome.results) if outcome.status == "ok" else f"  {mode}: {outcome.summary()}")
    finally:
        shutdown_pools()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
