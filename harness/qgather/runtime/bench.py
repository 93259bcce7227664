"""What the warm rank pool saves: cold start, warm per-case cost, spawn-per-case, crash recovery.

    python -m qgather.runtime.bench [--world-sizes 2,4,8] [--cases 200] [--spawn-reps 3]

The last line is the headline: `runtime overhead ratio (spawn-per-case / warm pool) at 4 ranks: N`.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qgather.runtime import OutcomeStatus, PoolSpec, RankPool, shutdown_pools
from qgather.runtime.probes import collectives_only, crash_rank, trivial
from qgather.runtime.spec import RANK_ENV_DEFAULTS

WARMUP_CASES = 20
RECOVERY_REPS = 3
SPAWN_TIMEOUT_S = 300.0


@dataclass
class Row:
    """One world size's measurements (the table's row)."""

    world_size: int
    cold_s: float
    warm_ms: float
    warm_p90_ms: float
    collectives_ms: float
    spawn_per_case_s: float | None
    recovery_s: float


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every world size, print the table, the goals and the headline ratio; 0 on success."""
    args = _parse(argv)
    print(_header())
    rows = []
    for world_size in args.world_sizes:
        row = _measure_gloo(world_size, args.cases, args.spawn_reps)
        rows.append(row)
    _print_table(rows)
    _print_goals(rows)
    _maybe_nccl(args.cases)
    shutdown_pools()
    ratio_row = next((r for r in rows if r.world_size == 4 and r.spawn_per_case_s), None)
    ratio = f"{ratio_row.spawn_per_case_s / (ratio_row.warm_ms / 1e3):.0f}" if ratio_row else "n/a (4 not measured)"
    print(f"runtime overhead ratio (spawn-per-case / warm pool) at 4 ranks: {ratio}")
    return 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m qgather.runtime.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8", help="comma-separated (default 2,4,8)")
    parser.add_argument("--cases", type=int, default=200, help="warm cases per world size (median)")
    parser.add_argument("--spawn-reps", type=int, default=3, help="spawn-per-case repetitions (0: skip)")
    args = parser.parse_args([] if argv is None else list(argv))  # None: defaults (as `qgather bench`)
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--world-sizes must be integers, got {args.world_sizes!r}")
    if not args.world_sizes or min(args.world_sizes) < 1 or args.cases < 1 or args.spawn_reps < 0:
        parser.error("world sizes and --cases must be >= 1, --spawn-reps >= 0")
    return args


def _header() -> str:
    method = os.environ.get("QGATHER_START_METHOD", "forkserver")
    return (f"runtime benchmark: gloo on CPU, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"python {sys.version.split()[0]}, start method {method}")


# -- gloo on CPU ----------------------------------------------------------------------------------


def _measure_gloo(world_size: int, cases: int, spawn_reps: int) -> Row:
    spec = PoolSpec("gloo", world_size, "cpu")
    shutdown_pools()  # a true cold start: no forkserver with torch already imported
    pool = RankPool(spec)
    try:
        cold = _timed(lambda: _expect_ok(pool.run(trivial)))
        for _ in range(WARMUP_CASES):
            _expect_ok(pool.run(trivial))
        warm = [_timed(lambda: _expect_ok(pool.run(trivial))) for _ in range(cases)]
        collectives = max(_expect_ok(pool.run(collectives_only, cases)).results)
        recovery = statistics.median(_recovery(pool) for _ in range(RECOVERY_REPS))
    finally:
        pool.shutdown()
    spawned = [_spawn_per_case(world_size) for _ in range(spawn_reps)]
    return Row(world_size, cold, statistics.median(warm) * 1e3, _p90(warm) * 1e3, collectives * 1e3,
               statistics.median(spawned) if spawned else None, recovery)


def _recovery(pool: RankPool) -> float:
    """A crash (rank 1 exits while the others wait), then the next trivial case on fresh ranks."""
    start = time.perf_counter()
    crashed = pool.run(crash_rank)
    if crashed.status is not OutcomeStatus.CRASH:
        raise RuntimeError(f"expected a crash, got {crashed.summary()}")
    _expect_ok(pool.run(trivial))
    return time.perf_counter() - start


def _spawn_per_case(world_size: int) -> float:
    """What a harness without a pool pays per case: spawn, process group, the case, exit."""
    context = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="qgather-bench-")
    env_backup = dict(os.environ)
    os.environ.update({**RANK_ENV_DEFAULTS, "OMP_NUM_THREADS": "1",
                       "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})
    start = time.perf_counter()
    try:
        procs = [context.Process(target=spawned_rank, args=(rank, world_size, os.path.join(tmpdir, "store")))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(SPAWN_TIMEOUT_S)
        elapsed = time.perf_counter() - start
        codes = [proc.exitcode for proc in procs]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
        shutil.rmtree(tmpdir, ignore_errors=True)
    if codes != [0] * world_size:
        raise RuntimeError(f"spawn-per-case ranks exited {codes}")
    return elapsed


def spawned_rank(rank: int, world_size: int, store_path: str) -> None:
    """One rank of a spawn-per-case run: join, the same barrier and all-gather a pool case does, leave."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=SPAWN_TIMEOUT_S))
    dist.barrier()
    torch.manual_seed(0)
    mine = torch.tensor([rank])
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    dist.destroy_process_group()


# -- NCCL (only with >= 2 GPUs) -------------------------------------------------------------------


def _maybe_nccl(cases: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("nccl 2 ranks: skipped (needs >= 2 CUDA GPUs)")
        return
    shutdown_pools()
    pool = RankPool(PoolSpec("nccl", 2, "cuda"))
    try:
        cold = _timed(lambda: _expect_ok(pool.run(trivial)))
        for _ in range(WARMUP_CASES):
            _expect_ok(pool.run(trivial))
        warm = [_timed(lambda: _expect_ok(pool.run(trivial))) for _ in range(cases)]
        collectives = max(_expect_ok(pool.run(collectives_only, cases)).results)
    finally:
        pool.shutdown()
    print(f"nccl 2 ranks: cold start {cold:.2f} s, warm per case "
          f"{statistics.median(warm) * 1e3:.2f} ms median / {_p90(warm) * 1e3:.2f} ms p90, "
          f"collectives alone {collectives * 1e3:.3f} ms")


# -- output ---------------------------------------------------------------------------------------


def _print_table(rows: list[Row]) -> None:
    columns = ["ranks", "cold start s", "warm/case ms (median)", "p90 ms", "gloo ops alone ms",
               "spawn-per-case s", "crash recovery s", "spawn/warm"]
    lines = [columns]
    for r in rows:
        spawn = f"{r.spawn_per_case_s:.2f}" if r.spawn_per_case_s else "-"
        ratio = f"{r.spawn_per_case_s / (r.warm_ms / 1e3):.0f}x" if r.spawn_per_case_s else "-"
        lines.append([str(r.world_size), f"{r.cold_s:.2f}", f"{r.warm_ms:.2f}", f"{r.warm_p90_ms:.2f}",
                      f"{r.collectives_ms:.2f}", spawn, f"{r.recovery_s:.2f}", ratio])
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    for i, line in enumerate(lines):
        print(" | ".join(cell.rjust(width) for cell, width in zip(line, widths)))
        if i == 0:
            print("-+-".join("-" * width for width in widths))
    print("cold start: forkserver (torch preloaded) + ranks + process group + first case; "
          "gloo ops alone: one all_reduce + one all_gather timed inside a rank")


def _print_goals(rows: list[Row]) -> None:
    for r in rows:
        recovery_ok = r.recovery_s <= r.cold_s + 1.0
        line = f"goal check {r.world_size} ranks: recovery <= cold start + 1 s: {'yes' if recovery_ok else 'NO'}"
        if r.world_size == 4:
            line += f"; warm per case <= 5 ms: {'yes' if r.warm_ms <= 5.0 else 'NO'}"
            if r.spawn_per_case_s:
                line += f"; ratio >= 200: {'yes' if r.spawn_per_case_s / (r.warm_ms / 1e3) >= 200 else 'NO'}"
        print(line)


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _expect_ok(outcome):
    if not outcome.ok:
        raise RuntimeError(f"benchmark case failed: {outcome.summary()}")
    return outcome


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
