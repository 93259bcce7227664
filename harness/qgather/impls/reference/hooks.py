"""The reference's FSDP2 all-gather hooks: `fsdp_pre_all_gather` lays this rank's row buffers on
the wire (qgather.impls.reference.wire says how, by mode), and `fsdp_post_all_gather` parses every
rank's section back, drops the padding and rebuilds the TransformerEngine layout with
`Format.from_rows` (re-padded scales, transposed and derived columnwise buffers), with the
per-tensor values of rank 0 where they travel (uneven shards), else this rank's own.

Under tensor parallelism (a weight distributed on a "tp" mesh, then fully_shard on "dp") the hooks
see this rank's TP piece: `orig_size` is the piece's shape, the mesh the "dp" one, and the `out=`
of a re-gather the unsharded DTensor on "tp", whose local tensor is refreshed.
"""

from __future__ import annotations

import math

import torch

from qgather.errors import HarnessFault
from qgather.impls.reference.wire import WireLayout, WireMeta, WireMode, pack_bytes, pack_planes, unpack_planes
from qgather.model.case import ShardLayout


class AllGatherHooks:
    """The FSDP2 hooks of QuantizedParam (qgather.impls.reference.param), a mixin over its storage
    (`_fmt`, `_rows`, `_glob`, `_te`, `_shape`, `_entries`)."""

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        if self._shape != tuple(orig_size) and self._shape[:-1] == tuple(orig_size[:-1]):
            return self._pre_all_gather_cols(mesh, orig_size)
        layout = ShardLayout(orig_size[0], mesh.size(), math.prod(orig_size[1:-1]))
        wire = self._padded_wire(layout.chunk * layout.inner_rows)
        mode = WireMode.SINGLE if layout.world_size == 1 else WireMode.ROWS if layout.even else WireMode.PLANES
        glob = self._metadata_glob()
        sent = glob if mode is WireMode.PLANES else {}
        wire_layout = WireLayout(
            fmt=self._fmt.name,
            full_shape=tuple(orig_size),
            world_size=layout.world_size,
            mode=mode,
            buffers=tuple((n, t.dtype, tuple(t.shape)) for n, t in wire.items()),
            per_tensor=tuple((n, t.dtype, tuple(t.shape)) for n, t in sent.items()),
        )
        meta = WireMeta(wire_layout, glob)
        if mode is WireMode.ROWS:
            return tuple(wire.values()), meta
        if mode is WireMode.SINGLE:
            return (pack_bytes(list(wire.values())),), meta
        plane_shape = (layout.chunk, *orig_size[1:])
        return pack_planes([*wire.values(), *sent.values()], plane_shape), meta

    def _pre_all_gather_cols(self, mesh, orig_size):
        """A Shard(1) piece: FSDP2 views every all-gather output as the shard's shape and
        concatenates the ranks along dim 1, so the row buffers travel as uint8 planes of exactly
        the shard's shape (M, K / ws), and the post-hook cuts each rank's columns back out."""
        wire = {n: t.contiguous() for n, t in self._rows.items()}
        layout = WireLayout(self._fmt.name, tuple(orig_size), mesh.size(), WireMode.COLS,
                            tuple((n, t.dtype, tuple(t.shape)) for n, t in wire.items()))
        return pack_planes(list(wire.values()), self._shape), WireMeta(layout, self._metadata_glob())

    def _padded_wire(self, padded_rows: int) -> dict[str, torch.Tensor]:
        wire = {}
        for name, t in self._rows.items():
            padded = t.new_zeros((self._entries(name, padded_rows), *t.shape[1:]))
            padded[: t.shape[0]].copy_(t)
            wire[name] = padded
        return wire

    def _metadata_glob(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self._glob.items()}

    def fsdp_post_all_gather(self, all_gather_outputs, metadata: WireMeta, param_dtype, *, out=None):
        layout = metadata.layout
        rows = self._gathered_rows(all_gather_outputs, layout)
        glob = self._per_tensor_values(all_gather_outputs, metadata)
        q = self._fmt.from_rows(rows, glob, layout.full_shape)
        if out is not None:
            from torch.distributed.tensor import DTensor  # loaded by FSDP2 by now; not when listing cases

            # Under tensor parallelism the unsharded parameter FSDP2 hands back is a DTensor on the
            # "tp" mesh whose local tensor is this rank's gathered piece: that is what to refresh.
            target = out._local_tensor if isinstance(out, DTensor) else out
            target._refresh(rows, glob, q.buffers)
            return None
        param = type(self)(self._fmt, rows, glob, layout.full_shape, param_dtype, te=dict(q.buffers))
        return param, ()

    def _per_tensor_values(self, outputs, metadata: WireMeta) -> dict[str, torch.Tensor]:
        """The gathered weight's per-tensor values: rank 0's from the planes where they travel (rank 0
        always holds rows, so a checkpoint load wrote them), else this rank's own."""
        layout = metadata.layout
        if not layout.per_tensor:
            return {n: t.clone() for n, t in metadata.glob.items()}
        first = [o[: layout.shard_layout.chunk] for o in outputs]
        values = unpack_planes(first, layout.buffers + layout.per_tensor)
        return {name: values[name].clone() for name, _, _ in layout.per_tensor}

    def _gathered_rows(self, outputs, layout: WireLayout) -> dict[str, torch.Tensor]:
        """Every rank's row buffers, concatenated in rank order, read as the wire mode says."""
        if layout.mode is WireMode.ROWS:
            return {name: t.clone() for (name, _, _), t in zip(layout.buffers, outputs)}
        if layout.mode is WireMode.PLANES:
            return self._rows_from_planes(outputs, layout)
        if layout.mode is WireMode.COLS:
            return self._rows_from_columns(outputs, layout)
        if layout.mode is WireMode.SINGLE:
            return self._trim(unpack_planes(outputs[:1], layout.buffers), layout, rank=0)
        raise HarnessFault(f"reference:{layout.fmt}: unknown wire mode {layout.mode!r}")

    def _rows_from_planes(self, outputs, layout: WireLayout) -> dict[str, torch.Tensor]:
        shards = layout.shard_layout
        per_rank: list[dict[str, torch.Tensor]] = []
        for rank in range(layout.world_size):
            section = [o[rank * shards.chunk : (rank + 1) * shards.chunk] for o in outputs]
            per_rank.append(self._trim(unpack_planes(section, layout.buffers), layout, rank))
        return {name: torch.cat([r[name] for r in per_rank]) for name, _, _ in layout.buffers}

    def _rows_from_columns(self, outputs, layout: WireLayout) -> dict[str, torch.Tensor]:
        """Each output holds the ranks' planes side by side along dim 1 (FSDP2's chunk-cat)."""
        m, k = layout.full_shape
        kc = k // layout.world_size
        per_rank = []
        for rank in range(layout.world_size):
            section = [o.reshape(m, k)[:, rank * kc : (rank + 1) * kc] for o in outputs]
            per_rank.append(unpack_planes(section, layout.buffers))
        return {name: torch.cat([r[name] for r in per_rank], dim=-1) for name, _, _ in layout.buffers}

    def _trim(self, buffers: dict[str, torch.Tensor], layout: WireLayout, rank: int) -> dict[str, torch.Tensor]:
        """Drop the padding entries of one rank's section: keep those of its real rows."""
        start, end = layout.shard_layout.row_range(rank)
        return {n: t[: self._entries(n, end - start)].clone() for n, t in buffers.items()}

    def _refresh(self, rows, glob, te) -> None:
        """The in-place (`out=`) path of the second and later all-gathers: refresh every field."""
        for store, new in ((self._rows, rows), (self._glob, glob), (self._te, te)):
            for name, t in new.items():
                store[name].copy_(t)

