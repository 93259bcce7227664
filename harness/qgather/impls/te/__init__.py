"""The TransformerEngine adapters, registered by name (FACTORIES):

  te                 TE's supported FSDP2 route: modules on meta under quantized_model_init,
                     fully_shard, reset_parameters (route.py)
  te:delayed         the same route with DelayedScaling (fp8_tensor; initial scale 1)
  te:prequantized    the full weight quantized with TE before fully_shard shards it: what happens
                     to a user who quantizes before sharding (prequantized.py)

Nothing here imports transformer_engine at import time: without it every te case is SKIPPED with
the import error as its reason.
"""

from qgather.impls.te.prequantized import PrequantizedImplementation
from qgather.impls.te.route import DelayedScalingRoute, TransformerEngineRoute

FACTORIES = {"te": TransformerEngineRoute, "te:delayed": DelayedScalingRoute,
             "te:prequantized": PrequantizedImplementation}
