"""The parameters of a `block` case: a transformer-like block whose every parameter sits in ONE
`fully_shard` group, as real training shards a block (one all-gather for the whole group: FSDP2's
foreach copy-in into one flat buffer, split-with-sizes copy-out), inside a model root with a
parameter of its own under the `nested` configuration.

The quantized weights are those of the `layers` scenario (qgather.model.layers: the case's shape
first, an aligned weight, a 3-D experts weight, each with its own data and magnitude); the block
puts high-precision parameters between them, in the group's order:

    first.weight     quantized, the case's shape (M1, K)
    norm.weight      plain (K,): the block's input is scaled by it, elementwise
    aligned.weight   quantized, (2 S u, K)
    bias.weight      plain (M2,): added to the aligned weight's output
    experts.weight   quantized, (2 S, u, K)
    root: scale.weight   plain (K,), in the root's own group: the model's input is scaled by it
                         (configuration `nested` only: the block inside a model root; without it
                         the block is the root)

so the group's flat buffer holds a quantized parameter's all-gather inputs, then a plain
parameter's, then another quantized one's. Nothing here touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from qgather.model.case import CaseSpec
from qgather.model.layers import LayerWeight, layer_weights

SCENARIO = "block"
#: each plain parameter's seed offset from the case's (beyond the quantized weights' SEED_STRIDE offsets)
PLAIN_SEED = 5000


@dataclass(frozen=True)
class PlainParam:
    """A high-precision parameter of the block (or of its root): its name, its 1-D length and seed."""

    name: str
    length: int
    seed: int
    in_root: bool = False

    @property
    def title(self) -> str:
        """How reports name it, e.g. `plain norm 64`."""
        return f"plain {self.name} {self.length}"


@dataclass(frozen=True)
class BlockParams:
    """The block's parameters: its quantized weights and its plain parameters, in the group's order."""

    first: LayerWeight
    aligned: LayerWeight
    experts: LayerWeight
    plain: tuple[PlainParam, ...]

    @property
    def quantized(self) -> tuple[LayerWeight, ...]:
        return (self.first, self.aligned, self.experts)


def block_params(spec: CaseSpec) -> BlockParams:
    """The parameters of a block case (its quantized weights are the layers scenario's)."""
    first, aligned, experts = layer_weights(spec)
    k, m2 = spec.shape[-1], aligned.spec.shape[0]
    plain = (PlainParam("norm", k, spec.seed + PLAIN_SEED), PlainParam("bias", m2, spec.seed + PLAIN_SEED + 1))
    if spec.config.nested:
        plain += (PlainParam("scale", k, spec.seed + PLAIN_SEED + 2, in_root=True),)
    return BlockParams(first, aligned, experts, plain)
