"""Small external adapters built on the reference, one per example in issue 8's "Why": each one
once got a verdict it had not earned. tests/test_why_examples.py holds the verdict each must get.
Loaded as `--impl tests._why_adapters:<Name>`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from qgather.formats import FORMATS
from qgather.impls.mutants import FACTORIES
from qgather.impls.reference import QuantizedParam, ReferenceImplementation

NibbleSwap = FACTORIES["mutant:nibble_swap"]


class WrongBytesThenRaisingForward(NibbleSwap):
    """Gathers wrong bytes, then its forward raises the same error on every rank, as a GEMM with an
    M % 16 rule would: the wrong bytes must still be judged."""

    bug = name = ""  # an external adapter, not a zoo member

    def forward(self, param, x):
        raise RuntimeError("GEMM needs M % 16 == 0")


class RaisingDequantize(ReferenceImplementation):
    """Gathers the right bytes; its own dequantize of the gathered weight raises on every rank, as TE's
    Float8BlockwiseQTensor.dequantize does where shards split its 128-row tiles."""

    def own_dequantize(self, param):
        raise RuntimeError("shape '[2, 128, 1, 128]' is invalid for input of size 16384")


class WrongBytesThenRaisingDequantize(NibbleSwap):
    """Gathers wrong bytes, then its own dequantize raises: the ERROR must still say which buffers differ."""

    bug = name = ""  # an external adapter, not a zoo member
    own_dequantize = RaisingDequantize.own_dequantize


class AlwaysRaisingMakeParam(ReferenceImplementation):
    """make_param raises a RuntimeError on every rank, whatever the shape: not a rejection."""

    def make_param(self, fmt, weight):
        raise RuntimeError("could not build the parameter")


class OutOfMemory(ReferenceImplementation):
    """Every rank runs out of memory building the parameter: not a rejection either."""

    def make_param(self, fmt, weight):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


class WrongOutputOnRank1(ReferenceImplementation):
    """The gathered buffers are right on every rank, but rank 1's layer output is off by one."""

    def forward(self, param, x):
        y = super().forward(param, x)
        return y + 1 if dist.is_initialized() and dist.get_rank() == 1 else y


class ChecksOnlyItsOwnShardParam(QuantizedParam):
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        rows = self.shape[0]
        if rows % self._fmt.row_block:
            raise ValueError(f"this shard's {rows} rows are not a multiple of {self._fmt.row_block}")
        return super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)

    def _check_alignment(self, start_dim0: int, what: str) -> None:
        pass  # shards anywhere; only the pre-hook looks, and only at its own shard


class ChecksOnlyItsOwnShard(ReferenceImplementation):
    """The pre-hook refuses a shard whose own row count is off the block, so with uneven shards some
    ranks refuse while the others would enter the all-gather: a deadlock, never a rejection."""

    param_class = ChecksOnlyItsOwnShardParam
    rejection_types = ("ValueError",)


class LateRejectionOnRank1(ReferenceImplementation):
    """The reference's own rejection, reached 2 s later on rank 1 (a loaded machine)."""

    def make_param(self, fmt, weight):
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(2.0)  # the delay is the example itself, not a synchronization
        return super().make_param(fmt, weight)


class DriftingQuantizer(ReferenceImplementation):
    """A self-consistent quantizer that scales with twice the amax: its gather is exactly its own
    q(W), which differs from the reference format's."""

    formats = ("fp8_tensor",)

    def _quantize(self, fmt, weight):
        return FORMATS[fmt].quantize(weight, amax=weight.detach().abs().amax().float() * 2)

    def make_param(self, fmt, weight):
        q = self._quantize(fmt, weight)
        rows, glob = FORMATS[fmt].to_rows(q)
        return QuantizedParam(FORMATS[fmt], rows, glob, tuple(weight.shape), weight.dtype, te=dict(q.buffers))

    def own_quantization(self, fmt, weight):
        return dict(self._quantize(fmt, weight).buffers)


class TwoArgumentPreHookParam(QuantizedParam):
    def fsdp_pre_all_gather(self, mesh, orig_size):  # neither signature FSDP2 calls
        return super().fsdp_pre_all_gather(mesh, orig_size, None, None, None)


class PreHookSignatureFSDP2Refuses(ReferenceImplementation):
    """A pre-hook whose signature FSDP2 cannot call: every rank raises, and it is no rejection."""

    param_class = TwoArgumentPreHookParam


class Bf16BytesParam(QuantizedParam):
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        # The shard's values in bf16, handed over as uint8 bytes: a label check sees FP8-sized bytes.
        values = self.dequantize().to(torch.bfloat16).contiguous()
        return (values.view(torch.uint8),), tuple(orig_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,) = all_gather_outputs
        full = gathered.view(torch.bfloat16).reshape(metadata)
        param = type(self).from_weight(self._fmt, full)
        return param, (gathered,)


class GathersBf16Bytes(ReferenceImplementation):
    """Gathers the shard as bf16 values disguised as bytes, then quantizes the gathered weight: the
    buffers come out right, the wire carried twice an FP8 shard."""

    param_class = Bf16BytesParam
