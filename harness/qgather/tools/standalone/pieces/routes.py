"""The libraries' own FSDP2 routes. torchao's `gathered_torchao` is a whole scenario (its first
unshard, as (label, first global row, got, want) stages); TransformerEngine's is three functions the
scenario (pieces.scenario) calls: `sharded_te` builds and shards the layer as TE's users do,
`read_te` reads the gathered weight, `requantize_te` is an optimizer step's re-quantization."""

# ruff: noqa: F821 -- the script defines CASE, SHAPE, ... and the other pieces' functions (see __init__)

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def gathered_torchao(rank: int, device: torch.device) -> list[tuple]:
    """torchao float8 training: convert_to_float8_training with the float8 all-gather, then torchao's
    own tensor-parallel style on "tp" (TP > 1) and fully_shard on "dp", as its FSDP2 + TP test does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    weight = make_weight(SHAPE, SEED, DTYPE)
    linear = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False, device=device, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.copy_(weight)
    linear.weight.requires_grad_(False)
    linear = convert_to_float8_training(linear, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    want, label, row0 = quantize(weight), "unshard 1", 0
    if TP > 1:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

        mesh = init_device_mesh(device.type, (WORLD_SIZE // TP, TP), mesh_dim_names=("dp", "tp"))
        parallelize_module(linear, mesh["tp"], Float8ColwiseParallel(), src_data_rank=None)
        fully_shard(linear, mesh=mesh["dp"])
        rows = shard_rows(SHAPE[0], TP, mesh.get_local_rank("tp"))  # this rank's TP piece
        want["data"], row0 = want["data"][rows], rows.start
        label += f": tp rank {mesh.get_local_rank('tp')} of {TP}: rows [{rows.start}, {rows.stop})"
    else:
        fully_shard(linear, mesh=init_device_mesh(device.type, (WORLD_SIZE,)))
    if PRECOMPUTE:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(linear)
    with float8_as_bytes_on_gloo():
        linear.unshard()
    w = linear.weight
    if TP > 1:
        w = w._local_tensor  # this rank's TP piece
    got = {"data": w._data.view(torch.uint8), "scale_inv": w._scale.float().reciprocal().reshape(1)}
    return [(label, row0, got, want)]


@contextlib.contextmanager
def float8_as_bytes_on_gloo():
    """gloo rejects float8 tensors in all-gather: hand it the same bytes viewed as uint8 (NCCL
    gathers float8 natively). Nothing the library computes changes."""
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]  # by torch version
    saved = {name: getattr(dist, name) for name in names if dist.get_backend() == "gloo"}

    def as_bytes(original):
        return lambda out, inp, *args, **kwargs: original(
            *(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (out, inp)), *args, **kwargs)

    for name, original in saved.items():
        setattr(dist, name, as_bytes(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def sharded_te(rank: int, device: torch.device):
    """TransformerEngine's FSDP2 route (its fsdp2 tests, its quantized_model_init example): te.Linear on
    meta under quantized_model_init, fully_shard, then reset_parameters writes and quantizes each
    rank's own part of the weight (its rows; its columns under Shard(1)). The layer and the float32 weight."""
    import transformer_engine.pytorch as te
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformer_engine.common import recipe

    weight = make_weight(SHAPE, SEED, torch.float32)
    if SHARD_DIM:
        mine = weight.to(DTYPE)[:, shard_rows(SHAPE[1], WORLD_SIZE, rank)].to(device)
    else:
        mine = weight.to(DTYPE)[shard_rows(SHAPE[0], WORLD_SIZE, rank)].to(device)

    def init_method(local: torch.Tensor) -> None:
        with torch.no_grad():
            local.copy_(mine)

    with te.quantized_model_init(enabled=True, recipe=getattr(recipe, RECIPE)()):
        linear = te.Linear(SHAPE[1], SHAPE[0], bias=False, params_dtype=DTYPE, device="meta", init_method=init_method)
    if SHARD_DIM:
        from torch.distributed.tensor import Shard

        fully_shard(linear, mesh=init_device_mesh(device.type, (WORLD_SIZE,)), shard_placement_fn=lambda p: Shard(1))
    else:
        fully_shard(linear, mesh=init_device_mesh(device.type, (WORLD_SIZE,)))
    with torch.enable_grad():
        linear.reset_parameters()
    return linear, weight


def read_te(linear, want: dict) -> dict:
    """The gathered weight's buffers (of the blockwise scales, the valid region)."""
    w = linear.weight
    if RECIPE == "Float8BlockScaling":  # of the padded scales, the valid region
        return {"rowwise_data": w._rowwise_data.view(torch.uint8),
                "rowwise_scale_inv": w._rowwise_scale_inv[tuple(slice(0, n) for n in want["rowwise_scale_inv"].shape)]}
    return {"data": w._data.view(torch.uint8), "scale_inv": w._scale_inv.float().reshape(1)}


def requantize_te(linear, rows: torch.Tensor) -> None:
    """An optimizer step's write into the sharded weight: TE re-quantizes the shard in place."""
    linear.weight.to_local().quantize_(rows)
