"""Adapters whose Nth gather after a weight was built is wrong; loaded as `tests._unshard_adapters:<Name>`
by tests/test_every_unshard.py (every rank imports them by that name). The wrong bit is in the GEMM
layout only (the rows the forward dequantizes stay right): no output comparison can see it, only a
comparison of that gathered weight with the golden."""

from __future__ import annotations

from typing import ClassVar

import torch

from qgather.impls.reference import QuantizedParam, ReferenceImplementation


def flip_first_byte(param: QuantizedParam) -> None:
    """One bit of the first TE-layout buffer's first byte flipped."""
    name = next(iter(param._te))
    param._te[name].view(torch.uint8).reshape(-1)[0] ^= 1


class CorruptsNthGatherParam(QuantizedParam):
    """The WRONG-th gather after a weight was built comes back with one bit flipped (counted per rank
    process; a new weight starts the count again)."""

    WRONG: ClassVar[int] = 1
    gathers: ClassVar[int] = 0

    @classmethod
    def from_weight(cls, fmt, weight):
        CorruptsNthGatherParam.gathers = 0
        return super().from_weight(fmt, weight)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        result = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
        CorruptsNthGatherParam.gathers += 1
        if CorruptsNthGatherParam.gathers == self.WRONG:
            flip_first_byte(out if out is not None else result[0])
        return result


class _First(CorruptsNthGatherParam):
    WRONG = 1


class _Third(CorruptsNthGatherParam):
    WRONG = 3


class _Fifth(CorruptsNthGatherParam):
    WRONG = 5


class WrongFirstGather(ReferenceImplementation):
    """Its first gather wrong: in a `dcp-wsA-trained` save, the training forward's."""

    param_class = _First


class WrongThirdGather(ReferenceImplementation):
    """Its third gather wrong: under `compile`, the compiled forward's own unshard (after the first
    unshard and the eager forward's)."""

    param_class = _Third


class WrongFifthGather(ReferenceImplementation):
    """Its fifth gather wrong: in `steps` under `compile`, the compiled forward's after step 1."""

    param_class = _Fifth
