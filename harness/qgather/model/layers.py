"""The weights of a `layers` case: a module of several quantized linear weights, derived from the case.

A `layers` case id reads like any other (`reference:nvfp4_2d:136x64:bf16:ws2:layers:s0`); its shape is
the module's FIRST weight, the one the suite picks from the format's regimes (misaligned, uneven,
aligned). The module adds two weights derived from the format's row unit u = max(row block, 16), the
shard world size S (the shard mesh's under HSDP) and the first weight's K:

    first    the case's shape                                       data seed: the case's seed
    aligned  (2 S u, K), or (3 S u, K) if that is the first's shape  every shard starts on a block
    experts  (2 S, u, K), or (2 S, 2u, K) if that is the first's     3-D, S ranks hold 2 experts each

so a case holds three weights of different shapes and regimes, all multiplied by the same input
(N, K). Each weight has its own data (seed + 1000 i) and its own magnitude (`SCALES`), so that two
weights never share an amax: a per-tensor scale one weight leaves behind for another is visible.
Nothing here touches a tensor: shape arithmetic for the policy, the suite and the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qgather.formats import FORMATS
from qgather.model.case import CaseSpec, shard_world_size

SCENARIO = "layers"
#: the scenarios whose case is a module of these weights: `layers` (a fully_shard group per weight) and
#: `block` (every weight in one group, qgather.model.block); the policy, the coverage and the
#: configurations read every weight of their cases
MODULE_SCENARIOS = (SCENARIO, "block")
#: each weight's magnitude, in module order (powers of two: the scaled values stay exact)
SCALES = (1.0, 8.0, 0.125)
SEED_STRIDE = 1000


@dataclass(frozen=True)
class LayerWeight:
    """One weight of a layers module: its name, its magnitude, and `spec`, the case with this
    weight's shape and data seed (what its shard layout, golden, policy and data are read from)."""

    name: str
    spec: CaseSpec
    scale: float

    @property
    def shape_text(self) -> str:
        return "x".join(str(d) for d in self.spec.shape)

    @property
    def title(self) -> str:
        """How reports name the weight, e.g. `weight aligned 256x64`."""
        return f"weight {self.name} {self.shape_text}"


def row_unit(fmt: str) -> int:
    """Rows of the format's scale block, at least 16 (the unit the suite's shapes are made of)."""
    return max(FORMATS[fmt].row_block, 16)


def layer_weights(spec: CaseSpec) -> tuple[LayerWeight, ...]:
    """The module's weights, in the order its forward runs (and gathers) them."""
    u, size, k = row_unit(spec.fmt), shard_world_size(spec), spec.shape[-1]
    first = tuple(spec.shape)
    aligned = (2 * size * u, k) if first != (2 * size * u, k) else (3 * size * u, k)
    experts = (2 * size, u, k) if first != (2 * size, u, k) else (2 * size, 2 * u, k)
    shapes = {"first": first, "aligned": aligned, "experts": experts}
    return tuple(LayerWeight(name, replace(spec, shape=shape, seed=spec.seed + SEED_STRIDE * i), SCALES[i])
                 for i, (name, shape) in enumerate(shapes.items()))
