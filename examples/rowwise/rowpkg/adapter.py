"""The qgather adapter of RowwiseFP8Tensor. It lists its own format (the object: loading the adapter
registers it), and its own quantizer (`own_quantization`), so that the gather is judged against the
library's q(W) and the quantizer against the format apart (QUANTIZER_MISMATCH).

Run from the folder that holds rowpkg/:
    qgather run --impl rowpkg.adapter:RowwiseImpl --world-sizes 1,2
"""

import math

import torch

from qgather.impls.base import Implementation
from rowpkg.format import Fp8RowwiseFormat
from rowpkg.tensor import RowwiseFP8Tensor, rowwise_quantize


class RowwiseImpl(Implementation):
    name = "rowlib"
    formats = (Fp8RowwiseFormat(),)          # its own format: the object, its class or "rowpkg.format:Fp8RowwiseFormat"
    scenarios = ("gather", "steps", "reshard")
    devices = ("cpu", "cuda")

    def make_param(self, fmt, weight):       # the quantized FULL weight; fully_shard shards it
        return RowwiseFP8Tensor.quantize(weight)

    def read_buffers(self, param):           # gathered buffers under the format's names
        return {"data": param._data.reshape(-1, param.shape[-1]), "scale_inv": param._scale_inv}

    def own_quantization(self, fmt, weight): # the library's quantizer on one device: the golden
        data, scale_inv = rowwise_quantize(weight)
        return {"data": data.reshape(-1, weight.shape[-1]), "scale_inv": scale_inv}

    def own_dequantize(self, param):         # the library's dequantization, compared too
        return param.dequantize(torch.float32)

    def requantize_shard(self, local, master_rows, group):  # an optimizer step: each row on its own, no all-reduce
        data, scale_inv = rowwise_quantize(master_rows)
        local._data.copy_(data)
        local._scale_inv.copy_(scale_inv)

    def wire_allowance(self, fmt, shape, shards, packed_bytes):  # what its gather moves: two byte planes
        plane = shards.chunk * math.prod(shape[1:])  # a padded shard's elements, one byte each
        return "data + scale plane", 2 * plane

    def is_quantized(self, param):
        return isinstance(param, RowwiseFP8Tensor)

    def config_skip_reason(self, spec):      # FSDP2 configurations this example leaves out
        if spec.config.tp or spec.config.saved_at_world_size or spec.config.shard_dim:
            return "RowwiseFP8Tensor shards along dim 0 only, with no tensor parallelism or checkpoints"
        return None
