"""The case sweeps that the suite (cases/, harness/suite_cases/) runs: which shapes, world sizes
and scenarios, per format.

Shapes are derived from each format's row block b so that every format gets the same kinds of
cases: aligned shards, shards that split a scale block (e.g. 136x64 at 8 ranks for NVFP4:
17-row shards), dim 0 not divisible by the world size, ranks with zero rows, dim 0 smaller than
the world size, K the format cannot hold, and 3-D expert weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from harness.cases import CaseSpec
from harness.formats import FORMATS
from harness.fsdp_config import DEFAULT, FsdpConfig

CPU_WORLD_SIZES = (1, 2, 3, 4, 8)
DTYPES = ("bf16", "fp32")

# K per format: a multiple of every format's K block, small enough for 2-core CI.
K = 64
# K values a format cannot hold (clean rejection expected), per format.
UNHOLDABLE_K = {"mxfp8": 48, "nvfp4_1d": 40, "nvfp4_2d": 40}


def alignment_shapes(fmt_name: str) -> list[tuple[int, ...]]:
    b = FORMATS[fmt_name].row_block
    # Sizes scale with the row block; per-tensor formats (b = 1) use 16-row units so that their
    # shapes are also ones GPU GEMMs accept (dims that are multiples of 16).
    u = max(b, 16)
    shapes = {
        (8 * u, K),  # aligned at 1, 2, 4 and 8 ranks; split blocks at 3
        (10 * u, K),  # even at 2 ranks; split blocks at 4 and 8
        (3 * u - 2, K),  # uneven at 3 ranks, aligned (chunks u, u, u-2) when b divides u
        (17 * u // 2, K),  # 136x64 for NVFP4: 17-row shards at 8 ranks
        (2 * u - 1, 2 * K),  # odd dim 0: uneven everywhere
        (4, K),  # dim 0 smaller than most world sizes: zero-row ranks
        (4, b, K),  # 3-D expert weights: FSDP2 shards the experts
        (3, b, K),  # 3-D, uneven expert split
    }
    if fmt_name.startswith("fp8_block"):
        shapes.add((200, 256))  # 128-row tiles split at 2 ranks (100-row shards)
    if fmt_name in UNHOLDABLE_K:
        shapes.add((8 * b, UNHOLDABLE_K[fmt_name]))
    return sorted(shapes)


@dataclass(frozen=True)
class Sweep:
    """A cross product of cases, narrowed by the session's command-line options."""

    scenarios: Sequence[str]
    world_sizes: Sequence[int] = CPU_WORLD_SIZES
    dtypes: Sequence[str] = DTYPES
    shapes: object = alignment_shapes  # callable(fmt) -> shapes
    formats: Sequence[str] | None = None
    seeds: Sequence[int] = (0,)
    configs: Sequence[FsdpConfig] = (DEFAULT,)
    marks: Sequence[str] = field(default_factory=tuple)

    def cases(
        self,
        impls: Iterable[str],
        formats: Iterable[str] | None = None,
        world_sizes: Iterable[int] | None = None,
        scenarios: Iterable[str] | None = None,
    ) -> list[CaseSpec]:
        fmts = [f for f in (self.formats or FORMATS) if formats is None or f in set(formats)]
        sizes = [w for w in self.world_sizes if world_sizes is None or w in set(world_sizes)]
        scens = [s for s in self.scenarios if scenarios is None or s in set(scenarios)]
        out = []
        for impl in impls:
            for fmt in fmts:
                for shape in self.shapes(fmt):
                    for dtype in self.dtypes:
                        for ws in sizes:
                            for scenario in scens:
                                for seed in self.seeds:
                                    for config in self.configs:
                                        if config.check_world_size(ws) is None:
                                            out.append(CaseSpec(impl, fmt, tuple(shape), dtype, ws, scenario,
                                                                seed, config))
        return out
