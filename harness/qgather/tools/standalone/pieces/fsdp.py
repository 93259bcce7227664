"""The case's FSDP2 configuration as a user writes it (qgather.scenarios.fsdp_setup): the mesh, the
`fully_shard` arguments, gloo's float8 transport, and the checkpoint of a dcp-wsA case (saved at
SAVED_AT ranks with torch.distributed.checkpoint, loaded at LOADED_AT into a module built from other
values); the launched world is the larger of the two, each phase on a mesh over its first ranks."""

# ruff: noqa: F821 -- the script defines TP, HSDP, MP, RAF, ... and the other pieces' functions (see __init__)

from __future__ import annotations

import math
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard


def fsdp_setup(device: torch.device, size: int):
    """FSDP2's mesh over ranks 0..size-1 (1-D; ("replicate", "shard") under HSDP; ("dp", "tp") under TP)
    and `fully_shard`'s arguments: the mesh ("dp" under TP), mixed precision, reshard_after_forward,
    the shard placement."""
    if TP:
        shape, names = (size // TP, TP), ("dp", "tp")
    else:
        if HSDP:
            shape, names = (HSDP, size // HSDP), ("replicate", "shard")
        else:
            shape, names = (size,), None
    if SAVED_AT:  # a checkpoint's two phases: each on the first ranks of the launched world
        mesh = sub_mesh(device, shape, names)
    else:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    if TP:
        kwargs = {"mesh": mesh and mesh["dp"]}  # FSDP2 shards each TP piece over "dp"
    else:
        kwargs = {"mesh": mesh}
    if RAF is not True:
        kwargs["reshard_after_forward"] = RAF
    if MP:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=MP, reduce_dtype=REDUCE)
    if SHARD_DIM:
        kwargs["shard_placement_fn"] = lambda param: Shard(1)
    return mesh, kwargs


def sub_mesh(device: torch.device, shape: tuple[int, ...], names):
    """A mesh over the first prod(shape) ranks of the launched world (None on the others): every
    rank creates every group, as torch.distributed requires."""
    if HSDP or TP:
        grid, groups = torch.arange(math.prod(shape)).view(shape), []
        for dim in range(len(shape)):
            lines = grid.movedim(dim, -1).reshape(-1, shape[dim]).tolist()
            made = [dist.new_group(line) for line in lines]
            groups.append(next((g for g, line in zip(made, lines) if dist.get_rank() in line), None))
        return DeviceMesh.from_group(groups, device.type, mesh=grid, mesh_dim_names=names) if groups[0] else None
    group = dist.new_group(list(range(shape[0])))
    return DeviceMesh.from_group(group, device.type) if dist.get_rank() < shape[0] else None


def float8_as_bytes_on_gloo() -> None:
    """gloo has no float8 all-gather: FSDP2's all-gathers move the same bytes viewed as uint8 (NCCL
    gathers float8 natively). Nothing the library computes changes."""
    names = ("all_gather_single", "all_gather_into_tensor")  # FSDP2 calls one, by torch version
    for name, gather in [(n, getattr(dist, n)) for n in names if hasattr(dist, n)]:
        setattr(dist, name, lambda out, inp, *args, _gather=gather, **kwargs: _gather(
            *(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (out, inp)), *args, **kwargs))


def saved_checkpoint(rank: int, device: torch.device) -> tuple[str, object]:
    """The checkpoint's directory, where the case's module built at SAVED_AT ranks (TRAINED: after
    one training forward) saved its state dict with torch.distributed.checkpoint; and the group of
    the LOADED_AT ranks that load it (every rank creates both groups)."""
    import torch.distributed.checkpoint as dcp

    path = [tempfile.mkdtemp(prefix="repro-dcp-") if rank == 0 else None]  # one directory: the ranks share a host
    dist.broadcast_object_list(path)
    group, loading = dist.new_group(list(range(SAVED_AT))), dist.new_group(list(range(LOADED_AT)))
    root, layers = sharded(rank, device, SAVED_AT, masters())
    if root is not None:
        if TRAINED:
            with torch.enable_grad():  # its collectives over the saving ranks (TE's amax: `group`)
                forward(root, make_input().to(device), group)
        dcp.save(root.state_dict(), checkpoint_id=path[0], process_group=group)
    dist.barrier()
    return path[0], loading
