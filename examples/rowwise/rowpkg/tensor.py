"""The library: an FP8 weight subclass with one scale per row and its FSDP2 all-gather hooks.

FSDP2 shards the weight by rows, so each rank's shard carries its own rows' scales: both the data
and the scales are gathered (no all-reduce: a row's scale needs no other rank's rows). Rows of at
least 4 elements (the scales ride in a byte plane of the shard's shape). Where FSDP2 shards over one
rank (world size 1, or HSDP's shard groups of one) it hands the post-hook only the first all-gather
input (qgather's docs/findings.md, "the world-size-1 path"), so there the two planes travel as one.
"""

import math

import torch
from torch.utils._pytree import tree_map_only

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
aten = torch.ops.aten
ROW_SLICES = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor}  # on dim 0: the rows' scales too
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.as_strided.default, aten.detach.default, aten.alias.default}
COPIES = {aten.new_zeros.default, aten.new_empty.default}


def rowwise_quantize(x):
    """The FP8 bits of x (as uint8, x's shape) and the float32 scale_inv of each row (rows: all dims but the last)."""
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    row_amax = x2.abs().amax(dim=1) if x2.shape[1] else x2.new_zeros(x2.shape[0])
    scale = FP8_MAX / row_amax
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    scale = torch.where(row_amax == 0, 1.0, scale)
    data = (x2 * scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return data.reshape(x.shape), 1.0 / scale


def rows_of(shape):
    """The scale rows of a weight of `shape`: all dims but the last."""
    return math.prod(shape[:-1])


class RowwiseFP8Tensor(torch.Tensor):
    """A weight as FP8 bits of its own shape and a scale per row."""

    @staticmethod
    def __new__(cls, data, scale_inv, dtype):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)
        self._data, self._scale_inv = data, scale_inv
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def quantize(cls, weight):
        if weight.dim() < 2:
            raise ValueError(f"RowwiseFP8Tensor holds weights of 2 or more dims, not {tuple(weight.shape)}")
        return cls(*rowwise_quantize(weight), weight.dtype)

    def dequantize(self, dtype=None):
        scale = self._scale_inv.reshape(*self._data.shape[:-1], 1)
        return (self._data.view(FP8).float() * scale).to(dtype or self.dtype)

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @classmethod
    def __tensor_unflatten__(cls, inner, dtype, outer_size, outer_stride):
        return cls(inner["_data"], inner["_scale_inv"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], cls) else None
        wrap = lambda data, scale: cls(data, scale, self.dtype)  # noqa: E731
        if func in ROW_SLICES and _dim(func, args, kwargs) == 0:  # FSDP2's sharding: rows with their scales
            data = func(self._data, *args[1:], **kwargs)
            inner = rows_of(self._data.shape[1:]) if self._data.dim() > 2 else 1
            per_row = self._scale_inv.view(self._data.shape[0], inner)
            scale = func(per_row, *args[1:], **kwargs)
            if isinstance(data, (list, tuple)):
                return [wrap(d, s.reshape(-1)) for d, s in zip(data, scale)]
            return wrap(data, scale.reshape(-1))
        if func in VIEWS:  # a view of the bits keeps the scales
            return wrap(func(self._data, *args[1:], **kwargs), self._scale_inv)
        if func in COPIES:  # FSDP2's padded shard: zero rows, zero scales
            size = args[1]
            data = func(self._data, size, **{**kwargs, "dtype": torch.uint8})
            return wrap(data, self._scale_inv.new_zeros(rows_of(size)))
        if func is aten.clone.default:
            return wrap(self._data.clone(), self._scale_inv.clone())
        if func is aten.copy_.default and isinstance(args[1], cls):
            args[0]._data.copy_(args[1]._data)
            args[0]._scale_inv.copy_(args[1]._scale_inv)
            return args[0]
        if func is aten._to_copy.default and kwargs.get("dtype") in (None, self.dtype):
            device = kwargs.get("device") or self.device
            return wrap(self._data.to(device), self._scale_inv.to(device))
        # any other op computes with the dequantized weight
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        # FSDP2 gathers equal, zero-padded shards, and wants every input of an uneven shard at the
        # padded shard's shape: the scales travel as a second uint8 plane of that shape, each row's
        # 4 scale bytes in its first 4 columns (K >= 4)
        padded = (-(-orig_size[0] // mesh.size()), *orig_size[1:])
        data = self._data.new_zeros(padded)
        data[: self._data.shape[0]].copy_(self._data)
        plane = self._data.new_zeros(padded)
        plane.view(-1, padded[-1])[: self._scale_inv.numel(), :4].copy_(self._scale_inv.view(torch.uint8).view(-1, 4))
        if mesh.size() == 1:  # FSDP2 hands a one-rank shard group's post-hook only the first input: send one
            return (torch.cat([data, plane]),), (orig_size[0],)
        return (data, plane), (orig_size[0],)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        # a shard group of one rank: the data and the scale plane came as one input, which is then the
        # one tensor FSDP2 frees and reallocates (whole: a view's size would shrink its storage)
        (data, plane), (rows,) = outputs[0].chunk(2) if len(outputs) == 1 else outputs, metadata
        kept = data[:rows]
        scale_inv = plane.view(-1, plane.shape[-1])[: rows_of(kept.shape), :4].contiguous().view(torch.float32).view(-1)
        if out is not None:  # FSDP2 gathered into the same storage again: the bits are new, the scales copied
            out._scale_inv.copy_(scale_inv)
            return None
        return RowwiseFP8Tensor(kept, scale_inv, param_dtype), tuple(outputs)


def _dim(func, args, kwargs):
    """The dim a split or slice cuts (0 by default, as aten's schemas say)."""
    position = 2 if func in (aten.split.Tensor, aten.split_with_sizes.default) else 1
    return kwargs.get("dim", args[position] if len(args) > position else 0)
