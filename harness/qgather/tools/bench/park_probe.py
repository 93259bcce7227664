"""A GPU probe, not a gate: what a kept golden stepping aside for the first unshard (Golden.step_aside,
qgather.scenarios.fsdp.aside_while_unsharding) saves of a benchmarked case's peak memory and costs in
time, the two measured in one pool, one after the other.

    python -m qgather.tools.bench.park_probe [--case CASE_ID ...] [--reps 3]

(by default the two cases `bench gpu` measures, fp8_block's and nvfp4_2d's).

fp8_block's peak on 2 x H200 (`qgather bench gpu`) was reached in FSDP2's lazy initialization inside
the first unshard: TE dequantizes the rank's shard for FSDP2's flat view (2 bf16 weights of float32
temporaries, docs/findings.md "te-fp8-block-flat-view-copy") beside TE's shard (0.5) and the golden
qgather keeps on the device (0.5, qgather.check.golden_cache), plus scales and a few small tensors: a
few MB over 3x. Each mode runs the case as `bench gpu` does (a warm-up, then `--reps` measured runs,
the peak over all of them above what was allocated before; the golden computed afresh in each mode's
warm-up):

  kept       the golden stays on the device (step_aside made to decline)
  aside      as the harness runs it: the golden's large buffers wait on the host during the unshard's
             lazy initialization and come back on a copy stream beside the collective

It prints each mode's verdicts, peak (in bf16 weights and MB against 3x) and the slowest rank's
median run, and each step's seconds on that rank in the median run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence

import torch

from qgather.check import golden_cache
from qgather.check.golden import Golden
from qgather.engine.classify import classify_results
from qgather.model.case import CaseSpec
from qgather.runtime import PoolSpec, get_pool, shutdown_pools
from qgather.tools.bench.case_bench import measured_runs

MODES = ("kept", "aside")
CASES = ("te:fp8_block:8192x28672:bf16:ws2:gather:s0", "te:nvfp4_2d:8192x28672:bf16:ws2:gather:s0")


def probe_on_rank(ctx, case_id: str, reps: int, mode: str) -> dict:
    """Runs on every rank: the case `reps` + 1 times under `mode`, measured as `bench gpu` measures it
    (case_bench.measured_runs)."""
    spec = CaseSpec.parse(case_id)
    golden_cache.forget(ctx.kept)  # every mode computes its golden in its own warm-up, as `bench gpu` does
    with _declining(mode == "kept"):
        runs = measured_runs(ctx, spec, reps)
    golden_cache.forget(ctx.kept)
    return {"runs": runs, "weight_bf16_bytes": spec.shape[0] * spec.shape[1] * 2}


@contextlib.contextmanager
def _declining(decline: bool) -> Iterator[None]:
    """With `decline`, no golden steps aside while the block runs."""
    if not decline:
        yield
        return
    step_aside = Golden.step_aside
    Golden.step_aside = lambda self: False
    try:
        yield
    finally:
        Golden.step_aside = step_aside


def _summary(mode: str, results: list[dict]) -> str:
    runs = len(results[0]["runs"])
    verdicts = [classify_results([r["runs"][i]["result"] for r in results]).verdict.value for i in range(runs)]
    peak, bf16 = max(run["peak_bytes"] for r in results for run in r["runs"]), results[0]["weight_bf16_bytes"]
    by_time = sorted(range(1, runs), key=lambda i: max(r["runs"][i]["full_s"] for r in results))
    median = by_time[len(by_time) // 2]
    slowest = max(results, key=lambda r: r["runs"][median]["full_s"])["runs"][median]
    over = peak - 3 * bf16
    margin = f"{abs(over) / 1e6:.1f} MB {'over' if over > 0 else 'within'} 3x"
    steps = ", ".join(f"{step} {seconds * 1e3:.2f}" for step, seconds in slowest["result"].seconds)
    return (f"  {mode:6s} verdicts {','.join(verdicts)}; peak {peak / bf16:.4f}x the bf16 weight ({margin}); "
            f"case {slowest['full_s'] * 1e3:.2f} ms (the median run's slowest rank: {steps} ms)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="park_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", dest="cases", help="a case id; repeat for several "
                        f"(default: {', '.join(CASES)})")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("park_probe: skipped: needs CUDA GPUs")
        return 0
    try:
        for case_id in args.cases or CASES:
            spec = CaseSpec.parse(case_id)
            pool = get_pool(PoolSpec(backend="nccl", world_size=spec.world_size, device="cuda"))
            print(f"{case_id}:")
            for mode in args.modes.split(","):
                outcome = pool.run(probe_on_rank, case_id, args.reps, mode, timeout=600.0)
                print(_summary(mode, outcome.results) if outcome.status == "ok" else f"  {mode}: {outcome.summary()}")
    finally:
        shutdown_pools()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
