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
    other.weight     quantized in the format's COMPANION (another family: other buffers, dtypes and
                     all-gather inputs in the same group), (2 S u', K), u' the companion's row unit
    experts.weight   quantized, (2 S, u, K)
    root: scale.weight   plain (K,), in the root's own group: the model's input is scaled by it
                         (configuration `nested` only: the block inside a model root; without it
                         the block is the root)

so the group's flat buffer holds a quantized parameter's all-gather inputs, then a plain
parameter's, then another quantized one's. Nothing here touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qgather.model.case import CaseSpec, shard_world_size
from qgather.model.layers import SEED_STRIDE, LayerWeight, layer_weights, row_unit

SCENARIO = "block"
#: each plain parameter's seed offset from the case's (beyond the quantized weights' SEED_STRIDE offsets)
PLAIN_SEED = 5000
#: the format of the block's `other` weight, per case format: one of another family, so that the group
#: holds two formats (per tensor beside microscaled or blockwise, NVFP4 beside FP8)
COMPANION = {"fp8_tensor": "mxfp8", "fp8_tensor_e5m2": "nvfp4_1d", "fp8_block": "nvfp4_2d",
             "fp8_block_1x128": "fp8_tensor", "mxfp8": "fp8_block", "nvfp4_1d": "fp8_tensor", "nvfp4_2d": "mxfp8"}
OTHER_SCALE = 2.0  # its magnitude (a power of two, unlike every other weight's)


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
    other: LayerWeight  # in the COMPANION format
    experts: LayerWeight
    plain: tuple[PlainParam, ...]

    @property
    def quantized(self) -> tuple[LayerWeight, ...]:
        """The quantized weights in the group's order."""
        return (self.first, self.aligned, self.other, self.experts)


def block_params(spec: CaseSpec) -> BlockParams:
    """The parameters of a block case (its quantized weights are the layers scenario's and one in the
    format's companion)."""
    first, aligned, experts = layer_weights(spec)
    fmt = COMPANION.get(spec.fmt, spec.fmt)
    shape = (2 * shard_world_size(spec) * row_unit(fmt), spec.shape[-1])
    other = LayerWeight("other", replace(spec, fmt=fmt, shape=shape, seed=spec.seed + 3 * SEED_STRIDE), OTHER_SCALE)
    k, m2 = spec.shape[-1], aligned.spec.shape[0]
    plain = (PlainParam("norm", k, spec.seed + PLAIN_SEED), PlainParam("bias", m2, spec.seed + PLAIN_SEED + 1))
    if spec.config.nested:
        plain += (PlainParam("scale", k, spec.seed + PLAIN_SEED + 2, in_root=True),)
    return BlockParams(first, aligned, other, experts, plain)


def module_weights(spec: CaseSpec) -> tuple[LayerWeight, ...]:
    """The quantized weights of a layers or block case (what the policy and the coverage read)."""
    return block_params(spec).quantized if spec.scenario == SCENARIO else layer_weights(spec)
