"""The libraries' own FSDP2 routes, each as four functions the scenario (pieces.scenario) calls:
`layer` builds one weight's layer as the library's users do (under TP with the library's own
tensor parallelism), `read` reads the gathered weight's buffers, `requantize` is an optimizer step's
write into the shard, `forward` runs the module as training code does."""

# ruff: noqa: F821 -- the script defines CASE, DTYPE, TP, ... and the other pieces' functions (see __init__)

from __future__ import annotations

import torch


def layer_torchao(master: torch.Tensor, rank: int, device: torch.device, size: int, mesh) -> torch.nn.Module:
    """torchao float8 training: an nn.Linear holding the weight, convert_to_float8_training with the
    float8 all-gather; under TP torchao's own style on "tp", as its FSDP2 + TP test does."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linear = torch.nn.Linear(master.shape[1], master.shape[0], bias=False, device=device, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.copy_(master)
    linear.weight.requires_grad_(False)
    linear = convert_to_float8_training(linear, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    if TP:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        style = Float8RowwiseParallel() if TP_DIM else Float8ColwiseParallel()
        parallelize_module(linear, mesh["tp"], style, src_data_rank=None)  # each rank cuts its own piece
    return linear


def read_torchao(weight: torch.Tensor, want: dict) -> dict:
    """The gathered Float8TrainingTensor: its float8 data and 1 / its tensorwise scale."""
    return {"data": weight._data.view(torch.uint8), "scale_inv": weight._scale.float().reciprocal().reshape(1)}


def requantize_torchao(layer: torch.nn.Module, rows: torch.Tensor) -> None:
    """torchao keeps the high-precision shard and casts it at every all-gather: a step writes the new rows."""
    layer.weight.to_local()._tensor.copy_(rows)


def layer_te(master: torch.Tensor, rank: int, device: torch.device, size: int, mesh) -> torch.nn.Module:
    """TransformerEngine's FSDP2 route (its fsdp2 tests, its quantized_model_init example): te.Linear on
    meta under quantized_model_init (under TP with TE's own tp_group); after fully_shard,
    reset_parameters writes this rank's part of the weight (init_method) and quantizes it."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    mine = local_part(master.to(DTYPE), rank, size).to(device)
    def init_method(local: torch.Tensor) -> None:  # noqa: E306 -- what TE calls on this rank's materialized shard
        with torch.no_grad():
            local.copy_(mine)
    with te.quantized_model_init(enabled=True, recipe=getattr(recipe, RECIPE)()):
        if TP:  # TE's own tensor parallelism: the module holds its piece
            return te.Linear(master.shape[1], master.shape[0], bias=False, params_dtype=DTYPE, device="meta",
                             init_method=init_method, tp_group=mesh["tp"].get_group(), tp_size=TP,
                             parallel_mode="row" if TP_DIM else "column")
        return te.Linear(master.shape[1], master.shape[0], bias=False, params_dtype=DTYPE, device="meta",
                         init_method=init_method)


def read_te(weight: torch.Tensor, want: dict) -> dict:
    """The gathered weight's buffers (of the blockwise scales, the valid region), after TE's own
    dequantize() of it (what its forward does with it) has run."""
    weight.dequantize()
    if RECIPE == "Float8BlockScaling":  # valid region
        scales = weight._rowwise_scale_inv[tuple(slice(0, n) for n in want["rowwise_scale_inv"].shape)]
        return {"rowwise_data": weight._rowwise_data.view(torch.uint8), "rowwise_scale_inv": scales}
    else:
        return {"data": weight._data.view(torch.uint8), "scale_inv": weight._scale_inv.float().reshape(1)}


def requantize_te(layer: torch.nn.Module, rows: torch.Tensor) -> None:
    """An optimizer step's write into the sharded weight: TE re-quantizes the shard in place."""
    layer.weight.to_local().quantize_(rows)


def forward_te(root: torch.nn.Module, x: torch.Tensor, group=None) -> torch.Tensor:
    """TE's forward under te.autocast with the case's recipe. `group`: the ranks the module is sharded
    over when they are not the whole launched world (a checkpoint's saving ranks), over which
    DelayedScaling's autocast reduces its amaxes: te.autocast's default is the whole world, which the
    ranks outside it never join (qgather saves in a world of the saving ranks alone)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    with te.autocast(enabled=True, recipe=getattr(recipe, RECIPE)(), amax_reduction_group=group):
        return root(x)


def forward_module(root: torch.nn.Module, x: torch.Tensor, group=None) -> torch.Tensor:
    """The module's own forward (`group`: TE's amax reduction group, which it has no use for)."""
    return root(x)
