"""The reference implementation: an FSDP2 tensor subclass for every format, correct by construction.

`QuantizedParam` stores a weight (or an FSDP2 shard of one) in its format's *row layout*
(`Format.to_rows`): every buffer indexed by groups of consecutive rows, padding removed. Sharding
dim 0 is then slicing each buffer by entries, which is exact whenever each shard starts on the
format's row block; shards that do not are rejected on every rank, never gathered wrong.

All-gather wire:
- world size 1: one flat uint8 input holding every row buffer, because FSDP2's world-size-1
  path (torch 2.13) hands only the first all-gather input to fsdp_post_all_gather;
- even shards (dim 0 divisible by the world size): each row buffer goes on the wire as it is,
  so the bytes moved equal the format's packed size;
- uneven shards: FSDP2 requires every all-gather input to have the padded shard's shape, so the
  padded row buffers are serialized into uint8 "planes" of that shape and parsed back per rank.
After the gather, `Format.from_rows` rebuilds the TransformerEngine layout (re-padded scales,
transposed and derived columnwise buffers); the unsharded parameter keeps both.

Mutants in `qgather.impls.mutants` subclass this class and override one small method each, so
every method here does one thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from qgather.formats import FORMATS, Format, FormatError
from qgather.impls.base import PACKED_SLACK, Implementation
from qgather.model.case import ShardLayout
from qgather.model.layout import column_block

aten = torch.ops.aten


class ShardAlignmentError(ValueError):
    """A shard boundary falls inside one of the format's scale blocks."""


@dataclass(frozen=True)
class WireLayout:
    """What every rank put on the wire, identical on all ranks (derived from shapes only)."""

    fmt: str
    full_shape: tuple[int, ...]
    world_size: int
    mode: str  # "rows" (each buffer as it is), "planes" (uneven shards), "single" (world size 1)
    buffers: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # name, dtype, padded shape

    @property
    def shard_layout(self) -> ShardLayout:
        return ShardLayout(self.full_shape[0], self.world_size, math.prod(self.full_shape[1:-1]))


@dataclass
class WireMeta:
    layout: WireLayout
    glob: dict[str, torch.Tensor]


def _device_of(rows: dict[str, torch.Tensor], glob: dict[str, torch.Tensor]) -> torch.device:
    for t in (*rows.values(), *glob.values()):
        return t.device
    return torch.device("cpu")


class QuantizedParam(torch.Tensor):
    _fmt: Format
    _rows: dict[str, torch.Tensor]
    _glob: dict[str, torch.Tensor]
    _te: dict[str, torch.Tensor] | None
    _flat_shape: tuple[int, ...] | None

    @staticmethod
    def __new__(
        cls,
        fmt: Format,
        rows: dict[str, torch.Tensor],
        glob: dict[str, torch.Tensor],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        te: dict[str, torch.Tensor] | None = None,
        flat_shape: tuple[int, ...] | None = None,
    ) -> QuantizedParam:
        logical = (math.prod(shape),) if flat_shape is not None else tuple(shape)
        self = torch.Tensor._make_wrapper_subclass(
            cls, logical, dtype=dtype, device=_device_of(rows, glob), requires_grad=False
        )
        self._fmt = fmt
        self._rows = rows
        self._glob = glob
        self._te = te
        self._flat_shape = tuple(shape) if flat_shape is not None else None
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _allow_in_checkpoints(cls)

    # ----------------------------------------------------------------- torch.compile (traceable subclass)
    # Dynamo and AOTAutograd take a subclass apart into its inner tensors and rebuild it from them
    # (on fake tensors while tracing): every buffer is an inner tensor, everything else is metadata.
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        names = [f"{_INNER}{kind}{_SEP}{key}" for kind, store in self._stores() for key in store]
        return names, (self._fmt.name, self._shape, self.dtype, self._flat_shape is not None, self._te is not None)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], meta: tuple, outer_size, outer_stride):
        fmt_name, shape, dtype, flat, has_te = meta
        stores: dict[str, dict[str, torch.Tensor]] = {"rows": {}, "glob": {}, "te": {}}
        for name, t in inner.items():
            kind, key = name[len(_INNER):].split(_SEP, 1)
            stores[kind][key] = t
        return cls(FORMATS[fmt_name], stores["rows"], stores["glob"], shape, dtype,
                   te=stores["te"] if has_te else None, flat_shape=shape if flat else None)

    def _stores(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        return [("rows", self._rows), ("glob", self._glob), ("te", self._te or {})]

    def __getattr__(self, name: str) -> Any:
        # the inner tensors named by __tensor_flatten__ (torch reads them with getattr)
        if name.startswith(_INNER):
            kind, key = name[len(_INNER):].split(_SEP, 1)
            return dict(self._stores())[kind][key]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ----------------------------------------------------------------- torch.distributed.checkpoint
    # DCP writes each shard with torch.save and reads it with torch.load(weights_only=True): the state
    # is the format's name and dicts of plain tensors, and the class is allowlisted (_allow_in_checkpoints).
    def __getstate__(self) -> dict[str, Any]:
        return {"fmt": self._fmt.name, "rows": dict(self._rows), "glob": dict(self._glob),
                "te": dict(self._te) if self._te is not None else None, "flat_shape": self._flat_shape}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._fmt = FORMATS[state["fmt"]]
        self._rows, self._glob, self._te = state["rows"], state["glob"], state["te"]
        self._flat_shape = state["flat_shape"]

    def __repr__(self) -> str:  # the default repr would dequantize through the fallback
        return f"{type(self).__name__}(format={self._fmt.name}, shape={tuple(self.shape)}, dtype={self.dtype})"

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_weight(cls, fmt: Format, weight: torch.Tensor) -> QuantizedParam:
        q = fmt.quantize(weight)
        rows, glob = fmt.to_rows(q)
        return cls(fmt, rows, glob, tuple(weight.shape), weight.dtype, te=dict(q.buffers))

    def _like(self, rows: dict[str, torch.Tensor], shape: tuple[int, ...], **kw: Any) -> QuantizedParam:
        return type(self)(self._fmt, rows, self._glob, shape, self.dtype, **kw)

    # ----------------------------------------------------------------- row geometry
    @property
    def _shape(self) -> tuple[int, ...]:
        return self._flat_shape or tuple(self.shape)

    @property
    def _inner_rows(self) -> int:
        return math.prod(self._shape[1:-1])

    def _entries(self, name: str, rows: int) -> int:
        return math.ceil(rows / self._fmt.rows_per_entry[name])

    def _check_alignment(self, start_dim0: int, what: str) -> None:
        start_row = start_dim0 * self._inner_rows
        block = self._fmt.row_block
        if start_row % block:
            raise ShardAlignmentError(
                f"reference:{self._fmt.name}: {what} starts at row {start_row}, not a multiple of the "
                f"{block}-row scale block of {self._fmt.name} (weight shape {self._shape}); "
                f"shards must hold a multiple of {block} rows"
            )

    def _slice_dim0(self, start: int, end: int) -> QuantizedParam:
        """Rows [start, end) of dim 0 as a view sharing this piece's buffers."""
        if (start, end) == (0, self._shape[0]):
            return self._like(self._rows, self._shape, te=self._te)
        first_row, last_row = start * self._inner_rows, end * self._inner_rows
        rows = {
            n: t[first_row // self._fmt.rows_per_entry[n] : self._entries(n, last_row)]
            for n, t in self._rows.items()
        }
        return self._like(rows, (end - start, *self._shape[1:]))

    # ----------------------------------------------------------------- dim-1 (Shard(1)) geometry
    def _col_entries(self, t: torch.Tensor, start: int, end: int) -> tuple[int, int]:
        """The last-dim entries of row buffer `t` that hold columns [start, end) of this piece."""
        width, k = t.shape[-1], self._shape[-1]
        return start * width // k, math.ceil(end * width / k)

    def _check_col_alignment(self, start: int, what: str) -> None:
        block = column_block(self._fmt.name)
        if len(self._shape) != 2:
            raise ShardAlignmentError(f"reference:{self._fmt.name}: {what}: dim-1 shards of a "
                                      f"{len(self._shape)}-D weight {self._shape} are not supported")
        if start % block:
            raise ShardAlignmentError(
                f"reference:{self._fmt.name}: {what} starts at column {start}, not a multiple of the "
                f"{block}-column scale block of {self._fmt.name} (weight shape {self._shape})"
            )

    def _slice_cols(self, start: int, end: int) -> QuantizedParam:
        if (start, end) == (0, self._shape[-1]):
            return self._like(self._rows, self._shape, te=self._te)
        rows = {}
        for name, t in self._rows.items():
            first, last = self._col_entries(t, start, end)
            rows[name] = t[..., first:last]
        return self._like(rows, (*self._shape[:-1], end - start))

    def _split_cols(self, sizes: list[int]) -> list[QuantizedParam]:
        return self._split_along(sizes, self._check_col_alignment, self._slice_cols,
                                 lambda i: f"dim-1 shard {i} of {len(sizes)} (split {sizes})")

    def _zeros_cols(self, cols: int) -> QuantizedParam:
        rows = {n: t.new_zeros((*t.shape[:-1], self._col_entries(t, 0, cols)[1])) for n, t in self._rows.items()}
        glob = {n: t.clone() for n, t in self._glob.items()}
        return type(self)(self._fmt, rows, glob, (*self._shape[:-1], cols), self.dtype)

    def _zeros(self, dim0: int) -> QuantizedParam:
        nrows = dim0 * self._inner_rows
        rows = {
            n: t.new_zeros((self._entries(n, nrows), *t.shape[1:])) for n, t in self._rows.items()
        }
        glob = {n: t.clone() for n, t in self._glob.items()}
        return type(self)(self._fmt, rows, glob, (dim0, *self._shape[1:]), self.dtype)

    def quantized_tensor(self):
        """This piece in the format's TransformerEngine layout."""
        return self._fmt.from_rows(self._rows, self._glob, self._shape)

    def dequantize(self) -> torch.Tensor:
        if self._shape[0] == 0:
            return torch.zeros(self._shape, dtype=torch.float32, device=self.device)
        return self._fmt.dequantize(self.quantized_tensor())

    # ----------------------------------------------------------------- ops FSDP2 applies
    def _split(self, sizes: list[int]) -> list[QuantizedParam]:
        return self._split_along(sizes, self._check_alignment, self._slice_dim0,
                                 lambda i: f"shard {i} of {len(sizes)} (dim-0 split {sizes})")

    @staticmethod
    def _split_along(sizes: list[int], check, piece, label) -> list[QuantizedParam]:
        """Consecutive pieces of `sizes` along one dimension, each non-empty one checked for alignment."""
        pieces, start = [], 0
        for index, size in enumerate(sizes):
            if size:
                check(start, label(index))
            pieces.append(piece(start, start + size))
            start += size
        return pieces

    def _slice(self, dim: int, start: int | None, end: int | None, step: int) -> QuantizedParam:
        dim0 = self._shape[0]
        if dim in (1, -1) and len(self._shape) == 2 and step == 1:
            k = self._shape[-1]
            start = max(0, min(k, 0 if start is None else start + k if start < 0 else start))
            end = max(start, min(k, k if end is None else end + k if end < 0 else end))
            if start:
                self._check_col_alignment(start, f"column slice [{start}:{end}]")
            return self._slice_cols(start, end)
        if dim != 0 or step != 1:
            raise NotImplementedError(
                f"reference:{self._fmt.name}: only contiguous dim-0 slices of a quantized weight are "
                f"supported, got dim={dim} step={step}"
            )
        start = max(0, min(dim0, 0 if start is None else start + dim0 if start < 0 else start))
        end = max(start, min(dim0, dim0 if end is None else end + dim0 if end < 0 else end))
        if start:
            self._check_alignment(start, f"slice [{start}:{end}]")
        return self._slice_dim0(start, end)

    def _as_strided(self, size: list[int], stride: list[int], offset: int | None) -> QuantizedParam:
        size, offset = tuple(size), offset or 0
        contiguous = tuple(torch.empty(0).new_empty(size).stride()) if size else ()
        row_numel = math.prod(self._shape[1:])
        if size[1:] == self._shape[1:] and tuple(stride) == contiguous and offset % row_numel == 0:
            start = offset // row_numel
            return self._slice(0, start, start + size[0], 1)
        raise NotImplementedError(
            f"reference:{self._fmt.name}: as_strided to size {size}, stride {tuple(stride)}, "
            f"offset {offset} is not a dim-0 slice of {self._shape}"
        )

    def _view(self, size: list[int]) -> QuantizedParam:
        size = tuple(size)
        if size == self._shape:
            return self._like(self._rows, self._shape, te=self._te)
        if size in ((-1,), (math.prod(self._shape),)):
            return self._like(self._rows, self._shape, flat_shape=self._shape)
        raise NotImplementedError(f"reference:{self._fmt.name}: cannot view {self._shape} as {size}")

    def _copy_from(self, src: torch.Tensor) -> None:
        if not isinstance(src, QuantizedParam) or src._shape != self._shape:
            raise NotImplementedError(
                f"reference:{self._fmt.name}: copy_ needs a quantized source of shape {self._shape}; "
                "re-quantize high-precision values with requantize_shard (it all-reduces the amax)"
            )
        self._assign(src._rows, src._glob)

    def _assign(self, rows: dict[str, torch.Tensor], glob: dict[str, torch.Tensor]) -> None:
        for name, t in rows.items():
            self._rows[name].copy_(t)
        for name, t in glob.items():
            self._glob[name].copy_(t)
        if self._te is not None:
            for name, t in self.quantized_tensor().buffers.items():
                self._te[name].copy_(t)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        # Anything else is compute (forward matmuls, printing): run it on the dequantized weight.
        def unwrap(t: QuantizedParam) -> torch.Tensor:
            return t.dequantize().to(t.dtype).reshape(t.shape)

        args, kwargs = tree_map_only(QuantizedParam, unwrap, (args, kwargs))
        return func(*args, **kwargs)

    # ----------------------------------------------------------------- FSDP2 all-gather hooks
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        if self._shape != tuple(orig_size) and self._shape[:-1] == tuple(orig_size[:-1]):
            return self._pre_all_gather_cols(mesh, orig_size)
        layout = ShardLayout(orig_size[0], mesh.size(), math.prod(orig_size[1:-1]))
        wire = self._padded_wire(layout.chunk * layout.inner_rows)
        mode = "single" if layout.world_size == 1 else "rows" if layout.even else "planes"
        wire_layout = WireLayout(
            fmt=self._fmt.name,
            full_shape=tuple(orig_size),
            world_size=layout.world_size,
            mode=mode,
            buffers=tuple((n, t.dtype, tuple(t.shape)) for n, t in wire.items()),
        )
        meta = WireMeta(wire_layout, self._metadata_glob())
        if mode == "rows":
            return tuple(wire.values()), meta
        if mode == "single":
            return (_pack_bytes(list(wire.values())),), meta
        plane_shape = (layout.chunk, *orig_size[1:])
        return _pack_planes(list(wire.values()), plane_shape), meta

    def _pre_all_gather_cols(self, mesh, orig_size):
        """A Shard(1) piece: FSDP2 views every all-gather output as the shard's shape and
        concatenates the ranks along dim 1, so the row buffers travel as uint8 planes of exactly
        the shard's shape (M, K / ws), and the post-hook cuts each rank's columns back out."""
        wire = {n: t.contiguous() for n, t in self._rows.items()}
        layout = WireLayout(self._fmt.name, tuple(orig_size), mesh.size(), "cols",
                            tuple((n, t.dtype, tuple(t.shape)) for n, t in wire.items()))
        return _pack_planes(list(wire.values()), self._shape), WireMeta(layout, self._metadata_glob())

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
        if layout.mode == "planes":
            rows = self._rows_from_planes(all_gather_outputs, layout)
        elif layout.mode == "cols":
            rows = self._rows_from_columns(all_gather_outputs, layout)
        elif layout.mode == "single":
            rows = self._trim(_unpack_planes(all_gather_outputs[:1], layout.buffers), layout, rank=0)
        else:
            rows = {name: t.clone() for (name, _, _), t in zip(layout.buffers, all_gather_outputs)}
        glob = {n: t.clone() for n, t in metadata.glob.items()}
        q = self._fmt.from_rows(rows, glob, layout.full_shape)
        if out is not None:
            out._refresh(rows, glob, q.buffers)
            return None
        param = type(self)(self._fmt, rows, glob, layout.full_shape, param_dtype, te=dict(q.buffers))
        return param, ()

    def _rows_from_planes(self, outputs, layout: WireLayout) -> dict[str, torch.Tensor]:
        shards = layout.shard_layout
        per_rank: list[dict[str, torch.Tensor]] = []
        for rank in range(layout.world_size):
            section = [o[rank * shards.chunk : (rank + 1) * shards.chunk] for o in outputs]
            per_rank.append(self._trim(_unpack_planes(section, layout.buffers), layout, rank))
        return {name: torch.cat([r[name] for r in per_rank]) for name, _, _ in layout.buffers}

    def _rows_from_columns(self, outputs, layout: WireLayout) -> dict[str, torch.Tensor]:
        """Each output holds the ranks' planes side by side along dim 1 (FSDP2's chunk-cat)."""
        m, k = layout.full_shape
        kc = k // layout.world_size
        per_rank = []
        for rank in range(layout.world_size):
            section = [o.reshape(m, k)[:, rank * kc : (rank + 1) * kc] for o in outputs]
            per_rank.append(_unpack_planes(section, layout.buffers))
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


_INNER, _SEP = "_qgather_", "__"


def _allow_in_checkpoints(cls: type) -> None:
    """DCP loads every saved shard with torch.load(weights_only=True), which rebuilds only allowlisted types."""
    torch.serialization.add_safe_globals([cls])


_allow_in_checkpoints(QuantizedParam)


def _pack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])


def _pack_planes(tensors: list[torch.Tensor], plane_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    flat = _pack_bytes(tensors)
    plane_numel = math.prod(plane_shape)
    n_planes = max(1, math.ceil(flat.numel() / plane_numel))
    padded = flat.new_zeros(n_planes * plane_numel)
    padded[: flat.numel()] = flat
    return tuple(padded.view(n_planes, *plane_shape).unbind(0))


def _unpack_planes(section, buffers) -> dict[str, torch.Tensor]:
    flat = torch.cat([p.reshape(-1) for p in section])
    out, offset = {}, 0
    for name, dtype, shape in buffers:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        chunk = flat[offset : offset + nbytes]
        if offset % itemsize:  # a buffer after one of an odd byte count (e.g. K = 17): view needs alignment
            chunk = chunk.clone()
        out[name] = chunk.view(dtype).reshape(shape)
        offset += nbytes
    return out


def _new_zeros(self: QuantizedParam, size, **kwargs) -> torch.Tensor:
    size = tuple(size)
    if size[1:] == self._shape[1:] and len(size) == len(self._shape):
        return self._zeros(size[0])
    if size[:-1] == self._shape[:-1] and len(size) == len(self._shape) == 2:
        return self._zeros_cols(size[-1])  # FSDP2's padded Shard(1) piece
    # FSDP2 pads its list of chunks with `new_empty(0)` placeholders that only report numel 0.
    return torch.zeros(size, dtype=kwargs.get("dtype") or self.dtype, device=self.device)


def _split_tensor(self: QuantizedParam, split_size: int, dim: int = 0):
    if dim in (1, -1) and len(self._shape) == 2:
        k = self._shape[-1]
        return self._split_cols([min(split_size, k - s) for s in range(0, k, split_size)] or [0])
    if dim != 0:
        raise NotImplementedError(f"reference:{self._fmt.name}: FSDP2 shards dim 0; got split on dim {dim}")
    dim0 = self._shape[0]
    sizes = [min(split_size, dim0 - s) for s in range(0, dim0, split_size)] or [0]
    return self._split(sizes)


def _split_with_sizes(self: QuantizedParam, split_sizes, dim: int = 0):
    if dim in (1, -1) and len(self._shape) == 2:
        return self._split_cols(list(split_sizes))
    if dim != 0:
        raise NotImplementedError(f"reference:{self._fmt.name}: FSDP2 shards dim 0; got split on dim {dim}")
    return self._split(list(split_sizes))


def _record_stream(self: QuantizedParam, stream) -> None:
    for t in (*self._rows.values(), *self._glob.values(), *(self._te or {}).values()):
        t.record_stream(stream)


def _to_copy(self: QuantizedParam, *, dtype=None, device=None, **kwargs):
    if dtype not in (None, self.dtype):
        return self.dequantize().to(dtype=dtype, device=device).reshape(self.shape)
    if device is None or torch.device(device) == self.device:
        return self._like(self._rows, self._shape, te=self._te, flat_shape=self._flat_shape)
    move = lambda d: {n: t.to(device) for n, t in d.items()}  # noqa: E731
    te = move(self._te) if self._te is not None else None
    return type(self)(self._fmt, move(self._rows), move(self._glob), self._shape, self.dtype, te=te,
                      flat_shape=self._flat_shape)


def _clone(self: QuantizedParam, **kwargs):
    copy = lambda d: {n: t.clone() for n, t in d.items()}  # noqa: E731
    te = copy(self._te) if self._te is not None else None
    return type(self)(self._fmt, copy(self._rows), copy(self._glob), self._shape, self.dtype, te=te,
                      flat_shape=self._flat_shape)


def _alias(self: QuantizedParam, *args, **kwargs):
    return self._like(self._rows, self._shape, te=self._te, flat_shape=self._flat_shape)


def _copy_(self: QuantizedParam, src, non_blocking: bool = False):
    self._copy_from(src)
    return self


_HANDLERS = {
    aten.split.Tensor: _split_tensor,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.slice.Tensor: lambda self, dim=0, start=None, end=None, step=1: self._slice(dim, start, end, step),
    aten.as_strided.default: lambda self, size, stride, storage_offset=None: self._as_strided(
        size, stride, storage_offset
    ),
    aten.view.default: lambda self, size: self._view(size),
    aten._unsafe_view.default: lambda self, size: self._view(size),
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_zeros,
    aten.copy_.default: _copy_,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.record_stream.default: _record_stream,
}


class ReferenceImplementation(Implementation):
    """qgather's own subclass: the expected behaviour every other implementation is judged by."""

    name = "reference"
    formats = tuple(FORMATS)
    param_class: type[QuantizedParam] = QuantizedParam
    rejection_types = (ShardAlignmentError, FormatError)

    def wire_allowance(self, fmt: str, shape: tuple[int, ...], shards: ShardLayout, packed_bytes: int):
        if getattr(shards, "shard_dim", 0) == 1 and shards.world_size > 1:
            # Shard(1): whole uint8 planes of the shard's shape (see _pre_all_gather_cols)
            plane = shards.dim0 * shards.col_chunk
            return "column planes", max(1, math.ceil(packed_bytes / plane)) * plane
        if shards.world_size == 1 or shards.even:
            return super().wire_allowance(fmt, shape, shards, packed_bytes)
        # Uneven shards: FSDP2 wants every input at the padded shard's shape, so the packed bytes
        # travel in byte planes of that shape (see fsdp_pre_all_gather): whole planes, not bytes.
        plane = shards.chunk * math.prod(shape[1:])
        return "byte planes", max(1, math.ceil(packed_bytes * PACKED_SLACK / plane)) * plane

    def make_param(self, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        return self.param_class.from_weight(FORMATS[fmt], weight)

    def read_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        if param._te is None:
            raise TypeError(f"{self.name}: the parameter holds no gathered TransformerEngine-layout buffers")
        return dict(param._te)

    def is_quantized(self, param: torch.Tensor) -> bool:
        return isinstance(param, QuantizedParam)

    def requantize_shard(self, local: torch.Tensor, master_rows: torch.Tensor, group) -> None:
        local._assign(*self._requantized(local, master_rows, group))

    def _requantized(self, local: QuantizedParam, master_rows: torch.Tensor, group):
        """The shard's new row buffers and per-tensor values (a zero-row shard has only the latter)."""
        fmt = local._fmt
        amax = self._global_amax(local, master_rows, group)
        if master_rows.shape[0] == 0:
            return {}, self._glob_for_amax(fmt, master_rows, amax)
        q = fmt.quantize(master_rows, amax=amax) if amax is not None else fmt.quantize(master_rows)
        return fmt.to_rows(q)

    def _global_amax(self, local: QuantizedParam, master_rows: torch.Tensor, group) -> torch.Tensor | None:
        """Per-tensor formats scale by the amax of the WHOLE weight: all-reduce the shards' amaxes."""
        if not local._glob:
            return None
        amax = master_rows.detach().abs().amax().float() if master_rows.numel() else master_rows.new_zeros(
            (), dtype=torch.float32
        )
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax

    @staticmethod
    def _glob_for_amax(fmt: Format, master_rows: torch.Tensor, amax: torch.Tensor | None):
        """A rank with zero rows still keeps the per-tensor values every rank agrees on."""
        if amax is None:
            return {}
        probe = master_rows.new_zeros((fmt.row_block * 2, master_rows.shape[-1]))
        return fmt.to_rows(fmt.quantize(probe, amax=amax))[1]
