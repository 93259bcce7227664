"""One case on one rank: the `RankCase` every step of a scenario reads (the pool's context, the case,
its implementation and format, the FSDP2 configuration's setup, the layer input and the phase
tracker), built once per case by `RankCase.prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qgather.check import golden_cache
from qgather.check.golden import Golden, golden_for, tensor_parallel_piece
from qgather.check.inspection import Inspector, TwinOutput
from qgather.errors import HarnessFault
from qgather.formats import FORMATS, Format
from qgather.impls import get_impl
from qgather.impls.base import Implementation
from qgather.model.case import CaseSpec, ColumnShardLayout, ShardLayout
from qgather.model.phases import PhaseTracker
from qgather.runtime.rank import CaseContext
from qgather.scenarios import fsdp_setup
from qgather.scenarios.data import make_input


@dataclass(frozen=True)
class RankCase:
    """What a scenario needs on one rank of the pool, for one case."""

    ctx: CaseContext  # rank, world size, device, process group, mesh
    spec: CaseSpec
    impl: Implementation
    fmt: Format
    phases: PhaseTracker  # where in the case this rank is (errors leaving it are tagged with it)
    setup: fsdp_setup.Setup  # the configuration's fully_shard kwargs, shard layout and dtype
    x: torch.Tensor  # the layer input, on the rank's device (a rowwise TP rank's: its K / T columns)
    checkpoint: str | None = None  # a dcp-wsA case: the directory its runner saved at world size A

    @classmethod
    def prepare(cls, ctx: CaseContext, spec: CaseSpec, phases: PhaseTracker, checkpoint: str | None = None) -> RankCase:
        """The case on this rank, its configuration translated for fully_shard (fsdp_setup.prepare)."""
        impl, fmt = get_impl(spec.impl), FORMATS[spec.fmt]
        if (spec.config.saved_at_world_size is None) != (checkpoint is None):
            raise HarnessFault("a dcp-wsA case runs with the checkpoint its runner saved (qgather.engine.checkpoint)")
        setup = fsdp_setup.prepare(ctx, spec)
        x = golden_cache.kept_in(ctx.kept).layer_input(spec, make_input)
        if setup.tp is not None:  # a rowwise TP rank multiplies its K / T columns of the input
            x = setup.tp.input_piece(x)
        # a contiguous copy of the kept input, on every device: a library's forward could write into it
        return cls(ctx, spec, impl, fmt, phases, setup, x.to(ctx.device, copy=True), checkpoint)

    def golden(self, weight: torch.Tensor, parked: bool = False) -> Golden:
        """What this rank's gathered weight must equal for the full `weight`: its golden, cut to
        this rank's TP piece under tensor parallelism. parked: a large golden waits on the host
        (Golden.park) until a check reads it."""
        tp = self.setup.tp
        if tp is None:
            return golden_for(self.fmt, weight, self.impl, parked)
        piece = tensor_parallel_piece(golden_for(self.fmt, weight, self.impl), tp.layout, tp.rank)
        if parked:
            piece.park()
        return piece

    def first_golden(self, weight: torch.Tensor) -> Golden:
        """`golden(weight, parked=True)` of the case's own weight (make_weight's, before any step), then
        back on the device for good (Golden.keep_on_device) and kept for the later cases of this rank
        process with the same implementation, format, shape, dtype and seed (qgather.check.golden_cache).
        Under tensor parallelism each TP rank's piece is cut anew (a golden of the piece is not kept)."""
        if self.setup.tp is not None:
            return self.golden(weight, parked=True)
        cache = golden_cache.kept_in(self.ctx.kept)
        golden = cache.get(golden_cache.GoldenKey.of(self.spec, self.ctx.device),
                           lambda: golden_for(self.fmt, weight, self.impl, parked=True))
        golden.keep_on_device()  # parked only while computed: the inspection reads it with no host copy
        return golden

    def golden_kept(self) -> bool:
        """Whether `first_golden` will find its golden kept (qgather.check.golden_cache), so that it
        reads nothing of the weight it is handed; never under tensor parallelism (a piece is cut anew)."""
        if self.setup.tp is not None:
            return False
        return golden_cache.kept_in(self.ctx.kept).holds(golden_cache.GoldenKey.of(self.spec, self.ctx.device))

    def kept_twin(self) -> TwinOutput | None:
        """The one-device twin's output an earlier case of this rank process computed for the same
        weight, configuration and compute dtype (qgather.check.golden_cache), or None."""
        return golden_cache.kept_in(self.ctx.kept).kept_twin(self._twin_key)

    def twin_output(self, weight: torch.Tensor) -> TwinOutput | None:
        """Inspector.twin_output of the case's own weight, kept for the later cases (`kept_twin`)."""
        twin = self.inspector.twin_output(weight, self.setup.param_dtype)
        return golden_cache.kept_in(self.ctx.kept).keep_twin(self._twin_key, twin)

    @property
    def _twin_key(self) -> golden_cache.TwinKey:
        return golden_cache.TwinKey.of(self.spec, self.ctx.device, self.setup.param_dtype)

    @property
    def shards(self) -> ShardLayout | ColumnShardLayout:
        """How the weight is sharded over the shard mesh (what the golden and the inspection see)."""
        return self.setup.shards

    @property
    def inspector(self) -> Inspector:
        """The inspection of this case's gathered weights (qgather.check.inspection)."""
        piece = "" if self.setup.tp is None else self.setup.tp.label
        return Inspector(self.spec, self.impl, self.fmt, self.x, self.setup.shards, piece)
