"""A rank's place in tensor parallelism (`tp-DxT`, `tp-DxT-row`): its split of the weight, its
coordinate on the "tp" mesh and that mesh. Built by qgather.scenarios.fsdp_setup and handed, as a
value, to whatever builds the module: the harness's route (qgather.scenarios.tensor_parallel) or a
library's own (TE's tp_group, qgather.impls.te.route)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from qgather.model.case import TensorParallelLayout


@dataclass(frozen=True)
class TensorParallelRank:
    """This rank's part in tensor parallelism: the split, its coordinate on "tp" and that mesh."""

    layout: TensorParallelLayout
    rank: int  # the coordinate on "tp"
    mesh: DeviceMesh  # the "tp" sub-mesh

    @property
    def rowwise(self) -> bool:
        return self.layout.dim == 1

    @property
    def label(self) -> str:
        return self.layout.label(self.rank)

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP piece of a full (M, K) tensor (a master weight, a gradient, a layer input's K)."""
        start, end = self.layout.piece_range(self.rank)
        return full.narrow(self.layout.dim, start, end - start)

    def input_piece(self, x: torch.Tensor) -> torch.Tensor:
        """The layer input this rank's piece multiplies: all of K (colwise), its K / T columns (rowwise)."""
        if not self.rowwise:
            return x
        start, end = self.layout.piece_range(self.rank)
        return x.narrow(-1, start, end - start)
