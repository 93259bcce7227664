"""The case model: one all-gather experiment with a stable, readable id.

A case id reads `impl:format:shape:dtype:wsN:scenario:sSEED[:CONFIG]`, e.g.
`reference:nvfp4_2d:136x64:bf16:ws8:gather:s0`; CONFIG, absent for FSDP2's defaults, says how
`fully_shard` is configured (qgather.model.config, e.g. `mp-bf16+raf-2`). The same id runs the same
experiment on every machine; backend and device are session options, not part of the case.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from qgather.errors import UsageError
from qgather.model.config import DEFAULT, ConfigError, FsdpConfig
from qgather.model.names import SCENARIOS

if TYPE_CHECKING:
    import torch

_SEED = re.compile(r"s\d+")
#: the dtypes a case id names (torch's dtype of each: `torch_dtype_of`)
DTYPES = ("bf16", "fp32")


def torch_dtype_of(name: str) -> torch.dtype:
    """torch's dtype of a case id's dtype name; torch is imported only here, so that reading and
    checking case ids (a command's bad input) costs no torch import."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


class CaseSpecError(UsageError):
    """A case id or field that cannot describe a case."""


@dataclass(frozen=True)
class CaseSpec:
    impl: str
    fmt: str
    shape: tuple[int, ...]
    dtype: str
    world_size: int
    scenario: str
    seed: int = 0
    config: FsdpConfig = DEFAULT

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CaseSpecError(f"case {self.id}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.scenario not in SCENARIOS:
            raise CaseSpecError(
                f"case {self.id}: scenario {self.scenario!r} is not one of {', '.join(SCENARIOS)}"
            )
        if self.world_size < 1:
            raise CaseSpecError(f"case {self.id}: world size must be >= 1, got {self.world_size}")
        if len(self.shape) < 2 or any(d < 1 for d in self.shape):
            raise CaseSpecError(f"case {self.id}: shape must have >= 2 positive dims, got {self.shape}")
        reason = self.config.check_world_size(self.world_size)
        if reason:
            raise CaseSpecError(f"case {self.id}: {reason}")

    @property
    def id(self) -> str:
        shape = "x".join(str(d) for d in self.shape)
        config = f":{self.config.token}" if not self.config.is_default else ""
        return f"{self.impl}:{self.fmt}:{shape}:{self.dtype}:ws{self.world_size}:{self.scenario}:s{self.seed}{config}"

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        """The world sizes of the rank pools the case runs on (a checkpoint case's saving world too;
        none for the virtual scenario, which runs in the runner's own process)."""
        if self.scenario == "virtual":
            return ()
        return tuple(sorted({self.world_size, self.config.saved_at_world_size or self.world_size}))

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype_of(self.dtype)

    @classmethod
    def parse(cls, case_id: str) -> CaseSpec:
        # The implementation name may itself hold colons (mutant:<bug>, package.module:object),
        # so the fixed fields are read from the right; a last field that is not sSEED is the config.
        parts = case_id.split(":")
        config = DEFAULT
        if len(parts) >= 8 and not _SEED.fullmatch(parts[-1]):
            try:
                config = FsdpConfig.parse(parts.pop())
            except ConfigError as exc:
                raise CaseSpecError(f"case id {case_id!r}: {exc}") from None
        if len(parts) < 7:
            raise CaseSpecError(
                f"case id {case_id!r} must read impl:format:MxK:dtype:wsN:scenario:sSEED[:CONFIG] "
                "(e.g. reference:nvfp4_2d:136x64:bf16:ws8:gather:s0)"
            )
        impl, (fmt, shape, dtype, ws, scenario, seed) = ":".join(parts[:-6]), parts[-6:]
        try:
            dims = tuple(int(d) for d in shape.split("x"))
            world_size = int(ws.removeprefix("ws"))
            seed_value = int(seed.removeprefix("s"))
        except ValueError:
            raise CaseSpecError(f"case id {case_id!r}: shape, wsN and sSEED must be integers") from None
        return cls(impl, fmt, dims, dtype, world_size, scenario, seed_value, config)

    @property
    def inner_rows(self) -> int:
        """Flattened rows per index of dim 0 (FSDP2 shards dim 0; quantization sees prod(shape[:-1]))."""
        return math.prod(self.shape[1:-1])

    @property
    def rows(self) -> int:
        return self.shape[0] * self.inner_rows


@dataclass(frozen=True)
class ShardLayout:
    """How FSDP2 splits dim 0 across ranks: torch.chunk semantics, padded to ceil(d0 / ws)."""

    dim0: int
    world_size: int
    inner_rows: int

    @property
    def chunk(self) -> int:
        return math.ceil(self.dim0 / self.world_size)

    @property
    def even(self) -> bool:
        return self.dim0 % self.world_size == 0

    def dim0_range(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.chunk, self.dim0)
        return start, min(start + self.chunk, self.dim0)

    def row_range(self, rank: int) -> tuple[int, int]:
        start, end = self.dim0_range(rank)
        return start * self.inner_rows, end * self.inner_rows

    def owner_of_row(self, row: int) -> int:
        return row // (self.chunk * self.inner_rows)

    def misaligned_rank(self, row_block: int) -> int | None:
        """The first rank whose shard starts off the format's row block, or None if all align."""
        for rank in range(self.world_size):
            start, end = self.row_range(rank)
            if end > start and start % row_block:
                return rank
        return None


@dataclass(frozen=True)
class ColumnShardLayout:
    """FSDP2's Shard(1) split of a 2-D (M, K) weight: every rank holds all rows and K / ws columns
    (FSDP2 requires even sharding on a nonzero dim). Duck-types ShardLayout where row code reads it."""

    dim0: int
    cols: int
    world_size: int
    inner_rows: int = 1
    shard_dim: int = 1

    @property
    def chunk(self) -> int:  # rows per rank: all of them
        return self.dim0

    @property
    def even(self) -> bool:
        return self.cols % self.world_size == 0

    @property
    def col_chunk(self) -> int:
        return self.cols // self.world_size

    def col_range(self, rank: int) -> tuple[int, int]:
        return rank * self.col_chunk, (rank + 1) * self.col_chunk

    def dim0_range(self, rank: int) -> tuple[int, int]:
        return 0, self.dim0

    def row_range(self, rank: int) -> tuple[int, int]:
        return 0, self.dim0 * self.inner_rows

    def owner_of_row(self, row: int) -> int:
        return 0  # every rank holds every row; owner_of_col says who holds a column

    def owner_of_col(self, col: int) -> int:
        return col // max(1, self.col_chunk)

    def misaligned_rank(self, col_block: int) -> int | None:
        """The first rank whose columns start off the format's column block (the row block does not
        matter: every rank holds all rows)."""
        for rank in range(self.world_size):
            start, end = self.col_range(rank)
            if end > start and start % col_block:
                return rank
        return None


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a tensor-parallel style splits a 2-D (M, K) weight over the "tp" mesh dimension:
    ColwiseParallel along dim 0 (M / T rows each), RowwiseParallel along dim 1 (K / T columns each),
    torch.chunk's split as DTensor's Shard makes it. FSDP2 then shards each piece along its dim 0
    over the "dp" dimension, so a TP rank's hooks see a piece of a piece."""

    shape: tuple[int, int]  # the full weight
    size: int  # T, the ranks of the "tp" dimension
    dim: int  # 0: colwise (Shard(0)), 1: rowwise (Shard(1))

    @property
    def chunk(self) -> int:
        return math.ceil(self.shape[self.dim] / self.size)

    @property
    def even(self) -> bool:
        return self.shape[self.dim] % self.size == 0

    def piece_range(self, tp_rank: int) -> tuple[int, int]:
        """[start, end) of TP rank `tp_rank`'s piece along the split dimension."""
        start = min(tp_rank * self.chunk, self.shape[self.dim])
        return start, min(start + self.chunk, self.shape[self.dim])

    def piece_shape(self, tp_rank: int = 0) -> tuple[int, int]:
        start, end = self.piece_range(tp_rank)
        return (end - start, self.shape[1]) if self.dim == 0 else (self.shape[0], end - start)

    def label(self, tp_rank: int) -> str:
        """How a report names the piece, e.g. "tp rank 1 of 2: rows [64, 128)"."""
        start, end = self.piece_range(tp_rank)
        return f"tp rank {tp_rank} of {self.size}: {'rows' if self.dim == 0 else 'columns'} [{start}, {end})"


def tensor_parallel_layout(spec: CaseSpec) -> TensorParallelLayout | None:
    """The case's TP split (None without tp-DxT)."""
    config = spec.config
    if config.tp is None:
        return None
    return TensorParallelLayout((spec.shape[0], spec.shape[-1]), config.tp[1], 1 if config.tp_style == "row" else 0)


def shard_world_size(spec: CaseSpec) -> int:
    """Ranks the weight is split over by FSDP2: the shard dimension of an HSDP mesh, the "dp"
    dimension under tensor parallelism, else the whole world."""
    if spec.config.hsdp:
        return spec.config.hsdp[1]
    return spec.config.tp[0] if spec.config.tp else spec.world_size


def shard_layout(spec: CaseSpec) -> ShardLayout | ColumnShardLayout:
    """How FSDP2 splits the case's weight under its configuration: the golden's and the inspection's
    view. Under tensor parallelism: how it splits each TP piece over the "dp" ranks."""
    size = shard_world_size(spec)
    if spec.config.shard_dim == 1:
        return ColumnShardLayout(spec.shape[0], spec.shape[-1], size)
    tp = tensor_parallel_layout(spec)
    if tp is not None:
        return ShardLayout(tp.piece_shape()[0], size, 1)
    return ShardLayout(spec.shape[0], size, spec.inner_rows)


def saved_spec(spec: CaseSpec) -> CaseSpec:
    """A dcp-wsA case as it runs at the checkpoint's world size A, where the save happens."""
    return replace(spec, world_size=spec.config.saved_at_world_size, config=spec.config.saved_config)
