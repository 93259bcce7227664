"""The reference implementation: an FSDP2 tensor subclass for every format, correct by construction.

  param.py    QuantizedParam: storage in the format's row layout, geometry, alignment checks
  ops.py      the aten ops FSDP2 shards it with (split, slice, view, new_zeros, copy_, ...)
  traced.py   its dequantization as one custom op (one node, not a dozen, in each torch.compile trace)
  hooks.py    its fsdp_pre_all_gather / fsdp_post_all_gather
  wire.py     what goes on the wire: the layout every rank agrees on, byte packing
  adapter.py  ReferenceImplementation, the adapter the harness loads as `reference`
"""

from qgather.impls.reference.adapter import ReferenceImplementation
from qgather.impls.reference.param import QuantizedParam, ShardAlignmentError
from qgather.impls.reference.wire import WireLayout, WireMeta, WireMode

__all__ = ["FACTORIES", "QuantizedParam", "ReferenceImplementation", "ShardAlignmentError", "WireLayout",
           "WireMeta", "WireMode"]

FACTORIES = {"reference": ReferenceImplementation}
