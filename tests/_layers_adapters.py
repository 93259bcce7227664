"""Adapters that break or refuse one weight of a several-weight module; loaded as
`tests._layers_adapters:<Name>` by tests/test_layers_scenario.py (every rank imports them by that
name)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch.distributed as dist

from qgather.errors import Refusal
from qgather.impls.mutants.sharding import MisalignedShardParam
from qgather.impls.reference import QuantizedParam, ReferenceImplementation, ShardAlignmentError
from qgather.model.case import ShardLayout
from tests._unshard_adapters import flip_first_byte


class CorruptsOneShapeParam(QuantizedParam):
    """Every gather of a weight of shape TARGET comes back with one bit flipped; others are right."""

    TARGET: ClassVar[tuple[int, ...]] = (64, 64)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        if metadata.layout.full_shape == self.TARGET:
            flip_first_byte(out if out is not None else result[0])
        return result


class WrongAlignedWeight(ReferenceImplementation):
    """The reference, except that the layers module's `aligned` weight at 2 ranks (64x64 for the
    16-row formats) is gathered with one bit flipped."""

    param_class = CorruptsOneShapeParam


class NoExperts(Refusal):
    """This adapter holds no 3-D weight."""


class RefusesExperts(ReferenceImplementation):
    """Refuses every 3-D weight with a declared rejection, on every rank, whatever its alignment."""

    rejection_types = (*ReferenceImplementation.rejection_types, NoExperts)

    def make_param(self, fmt, weight):
        if weight.dim() == 3 and self.refuses_here():
            raise NoExperts(f"{self.name}: no 3-D weights ({tuple(weight.shape)})")
        return super().make_param(fmt, weight)

    def refuses_here(self) -> bool:
        return True


class RefusesExpertsOnRankZero(RefusesExperts):
    """The same refusal, on rank 0 only: the other ranks build the weight."""

    def refuses_here(self) -> bool:
        return dist.get_rank() == 0


class RefusesInPreHookParam(MisalignedShardParam):
    """Shards anywhere, and refuses a misaligned weight in its pre-all-gather hook, on every rank
    (as TransformerEngine's NVFP4 hooks assert `shard_M % 16 == 0` there)."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        layout = ShardLayout(orig_size[0], mesh.size(), math.prod(orig_size[1:-1]))
        if layout.misaligned_rank(self._fmt.row_block) is not None:
            raise ShardAlignmentError(f"pre-all-gather hook: {tuple(orig_size)} splits a "
                                      f"{self._fmt.row_block}-row block")
        return super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)


class RefusesInPreHook(ReferenceImplementation):
    """Refuses misaligned shards in the pre-all-gather hook, not when sharding."""

    param_class = RefusesInPreHookParam
