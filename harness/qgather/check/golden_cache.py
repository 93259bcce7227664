"""Goldens, the library's one-device twin outputs and the layer inputs, kept for the later cases of
one rank process.

A case's first golden depends on its implementation, its format and its weight, which the case's
shape, dtype and seed determine (qgather.scenarios.data.make_weight), and on the device the weight is
drawn on; not on the world size, the FSDP2 configuration or the scenario. The cases of a pool that
share those share one golden instead of each quantizing the full weight again (`qgather bench gpu`
runs one case several times; a suite runs one weight under many configurations). The quantization
is deterministic, so a kept golden holds the bits a recomputed one would. The one-device twin's
output (qgather.check.inspection.TwinOutput: a few rows of layer output, or why there is none) is kept
the same way, by the golden's key, the configuration and the dtype the layer computes in.

A kept golden stays on the device, as one copy (Golden.keep_on_device): every inspection reads it
where it is, since bringing a large one back from host memory costs more than the checks
themselves (8.6 ms of a 24 ms inspection of an 8192x28672 FP8 blockwise weight on an H200); only
while the library's first unshard runs do its large rowwise buffers step aside to the host and come back
beside the collective (Golden.step_aside, qgather.scenarios.fsdp.aside_while_unsharding). It
holds at most `MAX_ENTRIES` goldens and `MAX_BYTES` of their buffers, the least recently used let
go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from qgather.check.golden import Golden
from qgather.check.inspection import TwinOutput
from qgather.model.case import CaseSpec

MAX_ENTRIES = 8
MAX_BYTES = 2 << 30
_KEPT_AS = "qgather.check.golden_cache"  # its key in CaseContext.kept


@dataclass(frozen=True)
class GoldenKey:
    """What a case's first golden is a function of."""

    impl: str
    fmt: str
    shape: tuple[int, ...]
    dtype: str
    seed: int
    device: str

    @classmethod
    def of(cls, spec: CaseSpec, device: torch.device) -> GoldenKey:
        return cls(spec.impl, spec.fmt, tuple(spec.shape), str(spec.dtype), spec.seed, str(device))


@dataclass(frozen=True)
class TwinKey:
    """What a case's one-device twin output is a function of."""

    weight: GoldenKey
    config: str
    compute_dtype: str

    @classmethod
    def of(cls, spec: CaseSpec, device: torch.device, compute_dtype: torch.dtype) -> TwinKey:
        return cls(GoldenKey.of(spec, device), spec.config.token, str(compute_dtype))


class GoldenCache:
    """Goldens by key, least recently used first, and twin outputs; `hits` and `misses` say how the
    goldens were served."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self._goldens: OrderedDict[GoldenKey, Golden] = OrderedDict()
        self._twins: OrderedDict[TwinKey, TwinOutput] = OrderedDict()
        self._inputs: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.hits = self.misses = 0

    def kept_twin(self, key: TwinKey) -> TwinOutput | None:
        """The twin output kept for `key`, or None."""
        twin = self._twins.get(key)
        if twin is not None:
            self._twins.move_to_end(key)
        return twin

    def keep_twin(self, key: TwinKey, twin: TwinOutput | None) -> TwinOutput | None:
        """Keep `twin` (None, the library has no twin: nothing to keep) for `key`; returns it."""
        if twin is not None:
            self._twins[key] = twin
            self._trim(self._twins)
        return twin

    def layer_input(self, spec: CaseSpec, make: Callable[[CaseSpec], torch.Tensor]) -> torch.Tensor:
        """The case's layer input as `make` draws it (qgather.scenarios.data.make_input), kept by the
        seed and K it depends on: drawing it costs a case of a large K a millisecond or two of host
        time. The caller copies it before handing it to a library (which could write into it)."""
        key = (spec.seed, spec.shape[-1])
        x = self._inputs.get(key)
        if x is None:
            x = self._inputs[key] = make(spec)
            self._trim(self._inputs)
        return x

    def _trim(self, kept: OrderedDict) -> None:
        """The least recently kept entries of `kept` let go, down to `max_entries`."""
        while len(kept) > self.max_entries:
            kept.popitem(last=False)

    def get(self, key: GoldenKey, compute: Callable[[], Golden]) -> Golden:
        """The golden kept for `key`, else `compute()`'s, kept when it holds a quantization (a golden
        that is only an error is cheap to recompute) and fits."""
        golden = self._goldens.get(key)
        if golden is not None:
            self._goldens.move_to_end(key)
            self.hits += 1
            return golden
        self.misses += 1
        golden = compute()
        if golden.q is not None and golden.nbytes <= self.max_bytes:
            self._goldens[key] = golden
            self._evict()
        return golden

    def holds(self, key: GoldenKey) -> bool:
        """Whether a golden is kept for `key`; computes nothing, and counts as no hit and no use."""
        return key in self._goldens

    def __len__(self) -> int:
        return len(self._goldens)

    def _evict(self) -> None:
        while len(self._goldens) > self.max_entries or sum(g.nbytes for g in self._goldens.values()) > self.max_bytes:
            self._goldens.popitem(last=False)


def forget(kept: MutableMapping[str, Any]) -> None:
    """Let go of every golden, twin output and layer input kept in `kept` (the next case makes its own)."""
    kept.pop(_KEPT_AS, None)


def kept_in(kept: MutableMapping[str, Any]) -> GoldenCache:
    """The golden cache of a rank process (CaseContext.kept), made on first use."""
    cache = kept.get(_KEPT_AS)
    if cache is None:
        cache = kept[_KEPT_AS] = GoldenCache()
    return cache
