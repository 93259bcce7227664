"""Tensor parallelism under FSDP2 (`tp-DxT`, `tp-DxT-row`): a rank's place on the ("dp", "tp") mesh,
its TP piece of a full tensor, and the module's weight distributed on "tp" the way TP users do it,
before `fully_shard(module, mesh=mesh["dp"])` (qgather.scenarios.module):

    parallelize_module(linear, mesh["tp"], ColwiseParallel())     # or RowwiseParallel(), or a library's styles

The style's `distribute_tensor` cuts the implementation's quantized FULL weight with the subclass's
own ops (torch.chunk along dim 0 or 1, then clone): what the subclass must support to be tensor
parallel. Every rank built the same full weight from the case seed, so each takes its own piece
locally (`src_data_rank=None`; a torch without that argument SKIPs these cases, qgather.scenarios.
fsdp_setup): the scatter from rank 0 that the default asks for would move the weight over the wire
as the subclass's c10d payload (a gloo scatter of the reference's wrapper subclass crashed), which
is not what is under test here. FSDP2 then shards each TP piece along dim 0 over "dp" (a `_StridedShard` when both split
dim 0), and after an unshard the weight is a DTensor on "tp" whose local tensor is this rank's
gathered piece: what the inspection compares with the golden's slice.
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from qgather.errors import HarnessFault
from qgather.impls.base import Implementation
from qgather.model.tp_rank import TensorParallelRank

#: whether this torch's parallelize_module lets each rank split its own copy (`src_data_rank=None`)
SPLITS_LOCALLY = "src_data_rank" in inspect.signature(parallelize_module).parameters
NO_LOCAL_SPLIT = (f"torch {torch.__version__}'s parallelize_module has no src_data_rank: its styles scatter the "
                  "weight from rank 0 as the subclass's c10d payload, which a wrapper subclass cannot be")


def distribute(impl: Implementation, module: torch.nn.Module, tp: TensorParallelRank) -> None:
    """The module's weight distributed on the "tp" mesh with the implementation's tensor-parallel
    style (torch's ColwiseParallel / RowwiseParallel unless the library has its own)."""
    if not SPLITS_LOCALLY:
        raise HarnessFault(NO_LOCAL_SPLIT)
    parallelize_module(module, tp.mesh, impl.tensor_parallel_style(tp.rowwise), src_data_rank=None)
    if not isinstance(module.weight, DTensor):
        raise TypeError(f"{impl.name}: after parallelize_module the weight is a {type(module.weight).__name__}, "
                        "not a DTensor on the tp mesh")


def local_piece(weight: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of a weight distributed on "tp" (the DTensor's local tensor); a weight a
    library split itself (TE's tp_group) is already the piece."""
    return weight._local_tensor if isinstance(weight, DTensor) else weight
