"""A toy FP8 per-tensor weight subclass with its FSDP2 all-gather hooks, and its qgather adapter.

Run from the folder above mypkg/ (qgather imports `mypkg` from the current directory):
    qgather run --impl mypkg.adapters:MyImpl --world-sizes 1,2
"""

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from qgather.impls.base import Implementation

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
aten = torch.ops.aten
VIEWS = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.view.default,
         aten._unsafe_view.default, aten.as_strided.default, aten.detach.default, aten.alias.default}
COPIES = {aten.new_zeros.default, aten.new_empty.default, aten.clone.default}


class MyShardAlignmentError(ValueError):
    """MyFP8Tensor refuses a weight it cannot hold (declared to qgather as a refusal)."""


def fp8_quantize(x, amax):
    """The FP8 bits of x (as uint8) and the float32 scale_inv, scaled by amax = max|W|."""
    scale = torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device) / amax.float()
    scale = torch.where(torch.isinf(scale), torch.finfo(torch.float32).max, scale)
    scale = torch.where(amax == 0, 1.0, scale)
    data = (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    return data, (1.0 / scale).reshape(1)


class MyFP8Tensor(torch.Tensor):
    """A weight as FP8 bits of its own shape and one scale; FSDP2 shards and gathers the bits."""

    @staticmethod
    def __new__(cls, data, scale_inv, dtype):
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)
        self._data, self._scale_inv = data, scale_inv
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def quantize(cls, weight, amax=None):
        if weight.dim() < 2:
            raise MyShardAlignmentError(f"MyFP8Tensor holds weights of 2 or more dims, not {tuple(weight.shape)}")
        amax = weight.detach().abs().amax().float() if amax is None else amax
        return cls(*fp8_quantize(weight, amax), weight.dtype)

    def dequantize(self, dtype=None):
        return (self._data.view(FP8).float() * self._scale_inv).to(dtype or self.dtype)

    def __tensor_flatten__(self):  # torch.compile takes it apart and rebuilds it
        return ["_data", "_scale_inv"], self.dtype

    @classmethod
    def __tensor_unflatten__(cls, inner, dtype, outer_size, outer_stride):
        return cls(inner["_data"], inner["_scale_inv"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VIEWS or func in COPIES:  # FSDP2's sharding and padding move the bits, keep the scale
            self = args[0]
            if func in (aten.new_zeros.default, aten.new_empty.default):
                kwargs = {**kwargs, "dtype": torch.uint8}
            out = func(self._data, *args[1:], **kwargs)
            scale = self._scale_inv if func in VIEWS else self._scale_inv.clone()
            wrap = lambda t: cls(t, scale, self.dtype)  # noqa: E731
            return [wrap(t) for t in out] if isinstance(out, (list, tuple)) else wrap(out)
        if func is aten.copy_.default and isinstance(args[1], cls):
            args[0]._data.copy_(args[1]._data)
            args[0]._scale_inv.copy_(args[1]._scale_inv)
            return args[0]
        if func is aten._to_copy.default and kwargs.get("dtype") in (None, args[0].dtype):
            self = args[0]
            return cls(self._data.to(kwargs.get("device") or self.device), self._scale_inv.clone(), self.dtype)
        # any other op computes with the dequantized weight
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        padded_rows = -(-orig_size[0] // mesh.size())  # FSDP2 gathers equal, zero-padded shards
        data = self._data.new_zeros((padded_rows, *self._data.shape[1:]))
        data[: self._data.shape[0]].copy_(self._data)
        return (data,), (self._scale_inv.clone(), orig_size[0])

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,), (scale_inv, rows) = outputs, metadata
        if out is not None:  # FSDP2 gathered into the same storage again: only the scale is new
            out._scale_inv.copy_(scale_inv)
            return None
        return MyFP8Tensor(data[:rows], scale_inv, param_dtype), (data,)


class MyImpl(Implementation):
    name = "mylib"
    formats = ("fp8_tensor",)                # harness format names it implements
    scenarios = ("gather", "steps", "reshard")
    devices = ("cpu", "cuda")                # cases of other devices are not run
    rejection_types = (MyShardAlignmentError,)  # errors that mean "I refuse this shape"

    def make_param(self, fmt, weight):       # the quantized FULL weight; fully_shard shards it
        return MyFP8Tensor.quantize(weight)

    def read_buffers(self, param):           # gathered buffers under TransformerEngine's names
        return {"data": param._data.reshape(-1, param.shape[-1]), "scale_inv": param._scale_inv}

    def requantize_shard(self, local, master_rows, group):  # steps/reshard: an optimizer step
        amax = master_rows.detach().abs().amax().float() if master_rows.numel() else torch.zeros(())
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # one scale for the whole weight
        data, scale_inv = fp8_quantize(master_rows, amax)
        local._data.copy_(data)
        local._scale_inv.copy_(scale_inv)

    def is_quantized(self, param):
        return isinstance(param, MyFP8Tensor)

    def own_dequantize(self, param):         # optional: its own dequantization, compared too
        return param.dequantize(torch.float32)

    def config_skip_reason(self, spec):      # FSDP2 configurations this toy leaves out
        if spec.config.tp or spec.config.saved_at_world_size or spec.config.shard_dim:
            return "MyFP8Tensor shards along dim 0 only, with no tensor parallelism or checkpoints"
        return None
