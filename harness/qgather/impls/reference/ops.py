"""The aten ops FSDP2 applies to the reference's parameter (split, slice, view, new_zeros, copy_, ...):
each one a method of `ShardingOps`, QuantizedParam's mixin, and `HANDLERS`, the op -> handler table
its `__torch_dispatch__` looks up. Every piece these ops cut is checked against the format's scale
blocks (`_check_alignment`), so a misaligned shard is refused on every rank, never gathered wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

aten = torch.ops.aten


class ShardingOps:
    """The sharding ops of QuantizedParam (qgather.impls.reference.param), whose storage and row
    geometry (`_shape`, `_slice_dim0`, `_check_alignment`, ...) they use."""

    def _split(self, sizes: list[int]) -> list[torch.Tensor]:
        return self._split_along(sizes, self._check_alignment, self._slice_dim0,
                                 lambda i: f"shard {i} of {len(sizes)} (dim-0 split {sizes})")

    @staticmethod
    def _split_along(sizes: list[int], check, piece, label) -> list[torch.Tensor]:
        """Consecutive pieces of `sizes` along one dimension, each non-empty one checked for alignment."""
        pieces, start = [], 0
        for index, size in enumerate(sizes):
            if size:
                check(start, label(index))
            pieces.append(piece(start, start + size))
            start += size
        return pieces

    def _slice(self, dim: int, start: int | None, end: int | None, step: int) -> torch.Tensor:
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

    def _as_strided(self, size: list[int], stride: list[int], offset: int | None) -> torch.Tensor:
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

    def _view(self, size: list[int]) -> torch.Tensor:
        size = tuple(size)
        if size == self._shape:
            return self._like(self._rows, self._shape, te=self._te)
        if size in ((-1,), (math.prod(self._shape),)):
            return self._like(self._rows, self._shape, flat_shape=self._shape)
        raise NotImplementedError(f"reference:{self._fmt.name}: cannot view {self._shape} as {size}")

    # ----------------------------------------------------------------- handlers of HANDLERS
    def _aten_new_zeros(self, size, **kwargs) -> torch.Tensor:
        size = tuple(size)
        if size[1:] == self._shape[1:] and len(size) == len(self._shape):
            return self._zeros(size[0])
        if size[:-1] == self._shape[:-1] and len(size) == len(self._shape) == 2:
            return self._zeros_cols(size[-1])  # FSDP2's padded Shard(1) piece
        # FSDP2 pads its list of chunks with `new_empty(0)` placeholders that only report numel 0.
        return torch.zeros(size, dtype=kwargs.get("dtype") or self.dtype, device=self.device)

    def _aten_split(self, split_size: int, dim: int = 0):
        if dim in (1, -1) and len(self._shape) == 2:
            k = self._shape[-1]
            return self._split_cols([min(split_size, k - s) for s in range(0, k, split_size)] or [0])
        if dim != 0:
            raise NotImplementedError(f"reference:{self._fmt.name}: FSDP2 shards dim 0; got split on dim {dim}")
        dim0 = self._shape[0]
        sizes = [min(split_size, dim0 - s) for s in range(0, dim0, split_size)] or [0]
        return self._split(sizes)

    def _aten_split_with_sizes(self, split_sizes, dim: int = 0):
        if dim in (1, -1) and len(self._shape) == 2:
            return self._split_cols(list(split_sizes))
        if dim != 0:
            raise NotImplementedError(f"reference:{self._fmt.name}: FSDP2 shards dim 0; got split on dim {dim}")
        return self._split(list(split_sizes))

    def _aten_record_stream(self, stream) -> None:
        for t in (*self._rows.values(), *self._glob.values(), *(self._te or {}).values()):
            t.record_stream(stream)

    def _aten_to_copy(self, *, dtype=None, device=None, **kwargs):
        if dtype not in (None, self.dtype):
            return self.dequantize().to(dtype=dtype, device=device).reshape(self.shape)
        if device is None or torch.device(device) == self.device:
            return self._like(self._rows, self._shape, te=self._te, flat_shape=self._flat_shape)
        move = lambda d: {n: t.to(device) for n, t in d.items()}  # noqa: E731
        te = move(self._te) if self._te is not None else None
        return type(self)(self._fmt, move(self._rows), move(self._glob), self._shape, self.dtype, te=te,
                          flat_shape=self._flat_shape)

    def _aten_clone(self, **kwargs):
        copy = lambda d: {n: t.clone() for n, t in d.items()}  # noqa: E731
        te = copy(self._te) if self._te is not None else None
        return type(self)(self._fmt, copy(self._rows), copy(self._glob), self._shape, self.dtype, te=te,
                          flat_shape=self._flat_shape)

    def _aten_alias(self, *args, **kwargs):
        return self._like(self._rows, self._shape, te=self._te, flat_shape=self._flat_shape)

    def _aten_copy_(self, src, non_blocking: bool = False):
        self._copy_from(src)
        return self


#: the aten ops FSDP2 applies to a shard (every other op dequantizes: QuantizedParam.__torch_dispatch__)
HANDLERS: dict[object, Callable[..., object]] = {
    aten.split.Tensor: ShardingOps._aten_split,
    aten.split_with_sizes.default: ShardingOps._aten_split_with_sizes,
    aten.slice.Tensor: lambda self, dim=0, start=None, end=None, step=1: self._slice(dim, start, end, step),
    aten.as_strided.default: lambda self, size, stride, storage_offset=None: self._as_strided(
        size, stride, storage_offset
    ),
    aten.view.default: lambda self, size: self._view(size),
    aten._unsafe_view.default: lambda self, size: self._view(size),
    aten.new_zeros.default: ShardingOps._aten_new_zeros,
    aten.new_empty.default: ShardingOps._aten_new_zeros,
    aten.copy_.default: ShardingOps._aten_copy_,
    aten.detach.default: ShardingOps._aten_alias,
    aten.alias.default: ShardingOps._aten_alias,
    aten.clone.default: ShardingOps._aten_clone,
    aten._to_copy.default: ShardingOps._aten_to_copy,
    aten.record_stream.default: ShardingOps._aten_record_stream,
}

