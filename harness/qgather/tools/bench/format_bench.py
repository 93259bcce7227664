"""CPU benchmark of every format's quantize() against a plain FP8 cast.

    python -c 'from qgather.tools.bench.format_bench import main; main()'      (or: qgather bench formats)

Quantizes one 4096x4096 bf16 weight with each format (a warm-up, then a few timed runs) and
times `x.float().to(torch.float8_e4m3fn)` in the same run, alternating with each format so that
other processes' load and the allocator's state (page faults of fresh 64 MB buffers) hit both
alike. Prints a table (format, best ms, median ms, cast ms, ratio of the medians) and last
`slowest format ratio: <name> <ratio>x (goal <= 15x)`. Always returns 0: it reports, it does not
fail on the goal. Uses torch's default thread count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from qgather.formats import FORMATS

GOAL = 15.0


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def paired_times(fn: Callable[[], object], cast: Callable[[], object], runs: int):
    """Times (ms) of fn and of the cast, taken alternately in the same rounds after a warm-up of each,
    so that other processes' load and the allocator's state affect both alike."""
    fn()
    cast()
    t_fn, t_cast = [], []
    for _ in range(runs):
        t_cast.append(_ms(cast))
        t_fn.append(_ms(fn))
    return t_fn, t_cast


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qgather bench formats", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="rows and columns of the weight")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per format (and of the cast)")
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), help="formats to time")
    args = parser.parse_args(list(argv) if argv is not None else [])

    torch.manual_seed(0)
    x = torch.randn(args.size, args.size, dtype=torch.bfloat16)

    def cast():
        return x.float().to(torch.float8_e4m3fn)

    print(f"formats bench: {args.size}x{args.size} bf16 on CPU, {torch.get_num_threads()} threads, "
          f"{args.runs} runs after a warm-up, torch {torch.__version__}")
    print("ratio = median(format) / median(cast), the cast timed alternately with each format")
    print(f"{'format':<18}{'best ms':>10}{'median ms':>11}{'cast ms':>10}{'x cast':>9}")
    slowest = ("", 0.0)
    for name in args.formats:
        fmt = FORMATS[name]
        t_fn, t_cast = paired_times(lambda fmt=fmt: fmt.quantize(x), cast, args.runs)
        ratio = statistics.median(t_fn) / statistics.median(t_cast)
        print(f"{name:<18}{min(t_fn):>10.1f}{statistics.median(t_fn):>11.1f}"
              f"{statistics.median(t_cast):>10.1f}{ratio:>9.2f}")
        if ratio > slowest[1]:
            slowest = (name, ratio)
    print(f"slowest format ratio: {slowest[0]} {slowest[1]:.2f}x (goal <= {GOAL:g}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
