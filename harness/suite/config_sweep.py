"""The FSDP2 configuration sweep: formats x shapes x dtypes x mixed precision x reshard_after_forward
x mesh (flat or HSDP) x shard dim x scenario, as a covering design (every pair of dimension values in
at least one case: qgather.suite.covering.pairwise) for the default run, or the full product (`slow`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from qgather.formats import FORMATS
from qgather.model.case import CaseSpec
from qgather.model.config import FsdpConfig
from qgather.suite.covering import pairwise
from qgather.suite.sweeps import SuiteSweep, narrow

MP = ("", "mp-bf16", "mp-bf16-rfp32", "mp-fp32", "mp-fp32-rbf16")
RAF = ("", "raf-no", "raf-S")  # raf-S: the int equal to the shard world size (smaller ints: FSDP2 cannot)
MESHES = ("ws2", "ws4", "hsdp-2x2", "hsdp-1x2", "hsdp-2x1")
SHARD_DIMS = ("", "dim1")
SCENARIOS = ("gather", "steps", "reshard")
DTYPES = ("bf16", "fp32")
SHAPES = ("aligned", "split")
IMPL_FORMATS = {"torchao": ("fp8_tensor",)}  # implementations that hold only some formats


def shape_for(fmt: str, kind: str) -> tuple[int, int]:
    """`aligned`: 8 row blocks (aligned at 2 and 4 ranks); `split`: 8.5 blocks (4-rank shards split a
    block). K holds two of the format's column blocks, so dim-1 shards align at 2 ranks, not at 4."""
    u = max(FORMATS[fmt].row_block, 16)
    k = 256 if fmt.startswith("fp8_block") else 64
    return (8 * u, k) if kind == "aligned" else (17 * u // 2, k)


def world_and_mesh(mesh: str) -> tuple[int, str]:
    if mesh.startswith("ws"):
        return int(mesh[2:]), ""
    r, s = (int(v) for v in mesh.removeprefix("hsdp-").split("x"))
    return r * s, mesh


def config_token(mp: str, raf: str, mesh: str, dim: str) -> str:
    _, hsdp = world_and_mesh(mesh)
    shard = int(hsdp.split("x")[1]) if hsdp else world_and_mesh(mesh)[0]
    raf = f"raf-{shard}" if raf == "raf-S" else raf
    return "+".join(p for p in (mp, raf, hsdp, dim) if p)


@dataclass(frozen=True)
class ConfigSweep(SuiteSweep):
    """The configuration dimensions as one covering array, impl x format a factor of it: unlike
    qgather.suite.sweeps.Sweep, not every (format, shape, world size, scenario) runs. The array is made over
    every value and then narrowed to the selection, so a narrowed run's ids are a subset of the full
    run's (one known-issues baseline serves both)."""

    product: bool = False
    marks: Sequence[str] = field(default_factory=tuple)
    #: beside the plugin's default implementation (reference), these run too
    also_with_default: Sequence[str] = ("torchao",)

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({world_and_mesh(m)[0] for m in MESHES}))

    @property
    def scenarios(self) -> tuple[str, ...]:
        return SCENARIOS

    def cases(self, impls: Iterable[str], formats: Iterable[str] | None = None,
              world_sizes: Iterable[int] | None = None, scenarios: Iterable[str] | None = None,
              exhaustive: bool = False) -> list[CaseSpec]:
        impls = list(impls)
        if impls == ["reference"]:
            impls += list(self.also_with_default)
        impl_fmts = [f"{i}|{f}" for i in impls for f in IMPL_FORMATS.get(i, FORMATS)]
        # The design is built over every value, then narrowed (as Sweep does): a run narrowed to some
        # formats, world sizes or scenarios runs a subset of the full run's ids, so a baseline written
        # from one applies to the other.
        factors = (impl_fmts, SHAPES, DTYPES, MP, RAF, MESHES, SHARD_DIMS, SCENARIOS)
        rows = itertools.product(*factors) if self.product or exhaustive else pairwise(factors)
        keep_fmts = set(narrow(FORMATS, formats))
        keep_scens = set(narrow(SCENARIOS, scenarios))
        keep_meshes = set(narrow(MESHES, world_sizes, key=lambda m: world_and_mesh(m)[0]))
        return [self._case(*row) for row in rows
                if row[0].split("|")[1] in keep_fmts and row[7] in keep_scens and row[5] in keep_meshes]

    @staticmethod
    def _case(impl_fmt, shape, dtype, mp, raf, mesh, dim, scenario) -> CaseSpec:
        impl, fmt = impl_fmt.split("|")
        ws, _ = world_and_mesh(mesh)
        config = FsdpConfig.parse(config_token(mp, raf, mesh, dim))
        return CaseSpec(impl, fmt, shape_for(fmt, shape), dtype, ws, scenario, 0, config)
