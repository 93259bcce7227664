"""The reference's parameter, `QuantizedParam`: an FSDP2 tensor subclass for every format, correct by
construction. This module holds its storage (row buffers, per-tensor values, TE layout), its row and
column geometry with the alignment checks, and what torch.compile and torch.distributed.checkpoint
need of it; the sharding ops (ops.py) and the all-gather hooks (hooks.py) are its mixins.

A weight is stored in its format's *row layout* (`Format.to_rows`): every buffer indexed by groups
of consecutive rows, padding removed. Sharding dim 0 is then slicing each buffer by entries, which
is exact whenever each shard starts on the format's row block; shards that do not are refused on
every rank (`ShardAlignmentError`), never gathered wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from qgather.errors import Refusal
from qgather.formats import FORMATS, Format
from qgather.impls.reference.hooks import AllGatherHooks
from qgather.impls.reference.ops import HANDLERS, ShardingOps
from qgather.impls.reference.traced import dequantized
from qgather.model.layout import column_block

__all__ = ["QuantizedParam", "ShardAlignmentError"]


class ShardAlignmentError(Refusal):
    """A shard boundary falls inside one of the format's scale blocks."""


def _device_of(rows: dict[str, torch.Tensor], glob: dict[str, torch.Tensor]) -> torch.device:
    for t in (*rows.values(), *glob.values()):
        return t.device
    return torch.device("cpu")


class QuantizedParam(AllGatherHooks, ShardingOps, torch.Tensor):
    """A weight (or an FSDP2 shard of one) held in its format's row layout: every buffer indexed by
    groups of consecutive rows, padding removed, with the per-tensor values (`_glob`) beside them and,
    for a gathered weight, the TransformerEngine layout (`_te`). Any op other than the sharding ops
    (qgather.impls.reference.ops) runs on the dequantized weight."""

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
        """The values this piece holds, in float32 (one op under torch.compile: qgather.impls.reference.traced)."""
        if self._shape[0] == 0:
            return torch.zeros(self._shape, dtype=torch.float32, device=self.device)
        return dequantized(self._fmt, self._rows, self._glob, self._shape)

    # ----------------------------------------------------------------- writing into the storage, and dispatch
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
        handler = HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        # Anything else is compute (forward matmuls, printing): run it on the dequantized weight.
        def unwrap(t: QuantizedParam) -> torch.Tensor:
            return t.dequantize().to(t.dtype).reshape(t.shape)

        args, kwargs = tree_map_only(QuantizedParam, unwrap, (args, kwargs))
        return func(*args, **kwargs)


_INNER, _SEP = "_qgather_", "__"


def _allow_in_checkpoints(cls: type) -> None:
    """DCP loads every saved shard with torch.load(weights_only=True), which rebuilds only allowlisted types."""
    torch.serialization.add_safe_globals([cls])


_allow_in_checkpoints(QuantizedParam)
