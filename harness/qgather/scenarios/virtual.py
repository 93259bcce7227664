"""The virtual scenario, in one process: every rank of the world emulated (FSDP2's chunking, each
rank's own shard and pre-hook, concatenation in rank order, the post-hook of every rank whose
metadata differs), so that world sizes up to 1024 run without a process group. Under `tp-DxT` the
TP style's split comes first and each piece is gathered by its D "dp" ranks (large dp x tp worlds,
e.g. 128 x 8, that no pool could run).

A rank may raise while the others would enter the collective: each virtual rank's result is its
RankResult or the exception it raised, tagged with its phase.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

import torch

from qgather.check.golden import Golden, golden_for, tensor_parallel_piece
from qgather.check.inspection import Inspector
from qgather.check.wire import record_wire, summarize_wire
from qgather.errors import HarnessFault
from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.model.case import CaseSpec, ShardLayout, TensorParallelLayout, shard_layout, tensor_parallel_layout
from qgather.model.phases import Phase, PhaseTracker
from qgather.model.records import VIRTUAL_GATHER, RankResult, Stage
from qgather.scenarios.data import make_input, make_weight
from qgather.scenarios.emulation import (
    PLAIN,
    VirtualMesh,
    checked_pre_all_gather,
    fsdp2_chunks,
    shard_like_fsdp2,
    tensor_parallel_pieces,
)


class WouldDeadlock(HarnessFault):
    """Virtual ranks that would hand the collective different sizes."""


@dataclass(frozen=True)
class _Piece:
    """What one group of virtual ranks all-gathers: the whole parameter, or under tensor
    parallelism one TP piece of it (gathered by the "dp" ranks of one "tp" coordinate)."""

    param: torch.Tensor  # the full parameter, or the TP piece as the TP style cut it
    golden: Golden
    inspector: Inspector
    ranks: tuple[int, ...]  # the global ranks that gather it, in dp order


def run_virtual(spec: CaseSpec) -> list[RankResult | BaseException]:
    """One process emulates every rank of the world. Returns one result (or the exception it raised,
    tagged with its phase) per virtual rank; an exception raised before the ranks split propagates.
    Under tensor parallelism the TP style's split of the full parameter comes first; then each
    piece is sharded, all-gathered and inspected by its own "dp" ranks (rank = dp * T + tp)."""
    impl, fmt = get_impl(spec.impl), FORMATS[spec.fmt]
    weight = make_weight(spec).to(spec.torch_dtype)
    golden = golden_for(fmt, weight, impl)
    shards, x = shard_layout(spec), make_input(spec)
    phases = PhaseTracker()
    with phases.tagging():
        param = impl.make_param(spec.fmt, weight)
        tp = tensor_parallel_layout(spec)
        if tp is None:
            pieces = [_Piece(param, golden, Inspector(spec, impl, fmt, x, shards), tuple(range(spec.world_size)))]
        else:
            with phases.at(Phase.SHARD):
                split = tensor_parallel_pieces(param, tp.size, tp.dim)
            pieces = [_Piece(piece, tensor_parallel_piece(golden, tp, t), Inspector(
                spec, impl, fmt, _input_piece(x, tp, t), shards, tp.label(t)),
                tuple(d * tp.size + t for d in range(spec.config.tp[0]))) for t, piece in enumerate(split)]
        results: list[RankResult | BaseException | None] = [None] * spec.world_size
        for piece in pieces:
            with phases.at(Phase.SHARD):
                chunks = fsdp2_chunks(piece.param, len(piece.ranks))
            for rank, result in zip(piece.ranks, _gather_piece(piece, chunks, shards, weight.dtype)):
                results[rank] = result
    return results


def _input_piece(x: torch.Tensor, tp: TensorParallelLayout, tp_rank: int) -> torch.Tensor:
    """The layer input a TP rank multiplies: all of K (colwise), its K / T columns (rowwise)."""
    if tp.dim == 0:
        return x
    start, end = tp.piece_range(tp_rank)
    return x[:, start:end].contiguous()


def _gather_piece(piece: _Piece, chunks: list[torch.Tensor], shards: ShardLayout,
                  dtype: torch.dtype) -> list[RankResult | BaseException]:
    """FSDP2 over one group of virtual ranks: each rank's padded shard and pre-hook, the all-gather
    as a concatenation in rank order, the post-hook of every distinct metadata, the inspection."""
    param, golden, inspector, ranks = piece.param, piece.golden, piece.inspector, piece.ranks
    full = torch.empty(tuple(param.shape), dtype=dtype, device="meta")
    locals_ = [_on_virtual_rank(Phase.SHARD, shard_like_fsdp2, param, chunk, shards) for chunk in chunks]
    mesh = VirtualMesh(len(ranks))
    param_type = next((type(t) for t in locals_ if not isinstance(t, BaseException)), type(param))
    with record_wire((param_type,)) as wire:
        pre = [t if isinstance(t, BaseException) else
               _on_virtual_rank(Phase.PRE_HOOK, checked_pre_all_gather, t, mesh, full.shape, shards)
               for t in locals_]
    if any(isinstance(p, BaseException) for p in pre):
        return pre  # the other ranks would wait in the all-gather
    shapes = [tuple((t.dtype, tuple(t.shape)) for t in inputs) for inputs, _ in pre]
    if len(set(shapes)) > 1:
        deadlock = WouldDeadlock("would deadlock: the virtual ranks hand the all-gather different sizes: "
                                 + "; ".join(f"rank {r} {s}" for r, s in zip(ranks, shapes)))
        deadlock.qgather_phase = Phase.COLLECTIVE.value
        return [deadlock] * len(ranks)
    outputs = tuple(torch.cat([inputs[i] for inputs, _ in pre]) for i in range(len(pre[0][0])))
    # The log saw every virtual rank's pre-hook: per rank (they all handed the same shapes) is 1/n of it.
    summary = summarize_wire(wire, inspector.fmt, full, shards, golden, inspector.impl)
    wire_summary = replace(summary, collective_bytes=sum(t.numel() * t.element_size() for t in pre[0][0]),
                           hook_calls=int(pre[0][1] is not PLAIN), collectives=int(len(ranks) > 1),  # the emulated one
                           hook_outputs=summary.hook_outputs[:len(pre[0][0])],
                           high_precision_elements=summary.high_precision_elements // len(ranks))
    results: list[RankResult | BaseException] = []
    seen: dict[Hashable, Stage | BaseException] = {}
    for rank, local, (_, metadata) in zip(ranks, locals_, pre):
        key = _metadata_key(metadata)
        if key not in seen:
            seen[key] = _on_virtual_rank(Phase.POST_HOOK, _post_and_inspect, inspector, local, outputs, metadata,
                                         dtype, golden)
        stage = seen[key]
        results.append(stage if isinstance(stage, BaseException) else
                       RankResult(rank, (stage,), wire_summary, golden.quantizer_diffs or None))
    return results


def _on_virtual_rank(phase: Phase, fn: Callable[..., Any], *args: Any) -> Any:
    """One virtual rank's step: its result, or the exception it raised (tagged with the phase)."""
    phases = PhaseTracker()
    try:
        with phases.at(phase), phases.tagging():
            return fn(*args)
    except Exception as exc:  # noqa: BLE001 - each virtual rank's own error is its result
        return exc


def _post_and_inspect(inspector: Inspector, local: torch.Tensor, outputs: tuple[torch.Tensor, ...], metadata: Any,
                      dtype: torch.dtype, golden: Golden) -> Stage:
    """One virtual rank's post-hook over the concatenated inputs, and the inspection of its result."""
    shards: ShardLayout = inspector.shards
    if metadata is PLAIN:
        unsharded = outputs[0][: shards.dim0]
    else:
        unsharded, _ = local.fsdp_post_all_gather(outputs, metadata, dtype)
    return inspector.judge(unsharded, golden, VIRTUAL_GATHER)


def _metadata_key(metadata: Any) -> Hashable:
    """Hashable content of a hook's metadata, to post-process each distinct metadata once: a tensor by
    its dtype, shape and every byte (two ranks' metadata that differ anywhere post-process apart)."""
    if isinstance(metadata, torch.Tensor):
        data = metadata.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(data.dtype), tuple(metadata.shape), data.view(torch.uint8).numpy().tobytes())
    if isinstance(metadata, dict):
        return tuple((k, _metadata_key(v)) for k, v in sorted(metadata.items(), key=lambda kv: str(kv[0])))
    if isinstance(metadata, (list, tuple)):
        return tuple(_metadata_key(v) for v in metadata)
    if isinstance(metadata, _ATOMS):  # by type and value, as a repr would tell them apart, without building it
        return type(metadata), metadata
    if hasattr(metadata, "__dict__"):
        return (type(metadata).__name__, _metadata_key(vars(metadata)))
    return repr(metadata)


#: metadata values keyed by themselves: hashable, and equal exactly when their reprs are (the emulation
#: keys every virtual rank's metadata, 1024 per case at most; an enum's repr alone was a tenth of it)
_ATOMS = (str, int, type(None), torch.dtype, enum.Enum)
