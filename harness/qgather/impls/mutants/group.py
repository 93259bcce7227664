"""Zoo bugs that only a `fully_shard` group of several quantized parameters shows (the block
scenario): FSDP2 runs every pre-all-gather hook of a group before its one copy-in, and every
post-all-gather hook after its one copy-out. A group of one parameter alternates pre- and post-hook,
so state a hook keeps per class between them is always its own; in a group of several it is the
last parameter's. Each class's docstring says which real failure it models.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from qgather.impls.reference import QuantizedParam

#: elements of a staging buffer (per class and dtype): more than any all-gather input of the suite,
#: so that every parameter of a group is staged in the same storage
STAGING_NUMEL = 1 << 22


class StagedWireParam(QuantizedParam):
    """Models a pre-all-gather hook that stages its all-gather inputs in a buffer kept per class (a
    scratch buffer a quantizer or a tensor class reuses to spare an allocation per gather, as
    communication buffers are pooled) and hands FSDP2 views of it. FSDP2 copies the inputs into its
    flat buffer only after every pre-hook of the group ran: each parameter's pre-hook overwrites the
    staged bytes of the one before, whose views now hold the last parameter's bytes.

    Alone in its group (every one-weight case, and each layer of the layers scenario) the copy-in
    reads the views right after their own pre-hook: every gather is right."""

    _staging: ClassVar[dict[tuple, torch.Tensor]] = {}

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, meta = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        offsets: dict[tuple, int] = {}
        staged = []
        for t in inputs:
            key = (type(self), t.dtype, t.device)
            start = offsets.get(key, 0)
            buffer = self._staging.get(key)
            if buffer is None or buffer.numel() < start + t.numel():
                buffer = self._staging[key] = t.new_empty(max(STAGING_NUMEL, start + t.numel()))
            # BUG: one staging buffer per class, filled from its start by every parameter's pre-hook.
            view = buffer[start:start + t.numel()].view(t.shape)
            view.copy_(t)
            staged.append(view)
            offsets[key] = start + t.numel()
        return tuple(staged), meta


class ClassWirePlanParam(QuantizedParam):
    """Models a post-all-gather hook that reads its gathered buffers with the wire plan (how many
    all-gather inputs, in which dtypes) its class's last pre-hook handed over, kept on the class (a
    quantizer shared by a recipe's weights that remembers what it sent), instead of the plan in its
    own metadata. FSDP2 allocates each parameter's outputs in the dtypes and count of its own inputs;
    the hook reinterprets them (`view(dtype)`) and takes as many as the plan says.

    A neighbour in the same group whose inputs differ in count or dtype from this parameter's (a
    weight of other shards: byte planes beside row buffers; another format) makes the earlier
    parameters' post-hooks read their outputs with the wrong plan. With the same count and dtypes the
    views are identities: a group of one parameter, or of weights sent alike, is right."""

    _plans: ClassVar[dict[type, tuple[torch.dtype, ...]]] = {}

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, meta = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        type(self)._plans[type(self)] = tuple(t.dtype for t in inputs)
        return inputs, meta

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        plan = type(self)._plans.get(type(self))
        if plan is not None:
            # BUG: the class's last plan, not this parameter's: count and dtypes of another parameter's inputs.
            all_gather_outputs = tuple(o.view(dtype) for o, dtype in zip(all_gather_outputs, plan))
        return super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
