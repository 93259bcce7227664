"""The `model` scenario of the te route: a small TE model trained the way TE's FSDP2 users train it,
against the same model and recipe on one GPU.

The model (hidden H, ffn F; the case's shape reads `HxF`):

    h = x + LayerNormLinear(H -> H)(x)
    h = h + LayerNormMLP(H -> F -> H)(h)
    y = TransformerLayer(H, F, H // 64 heads)(h)        loss = mean(y^2)

Weights (3H x H), (F x H), (H x F), (H x H): with H = 128 and F = 352 the shard rows are
aligned to NVFP4's 16 rows at 2 ranks but not at 4 (F / 4 = 88), and never aligned to the
blockwise formats' 128-row tiles at 2 ranks. Every child is `fully_shard`ed, then the root, as
TE's own FSDP2 tests do; `reset_parameters()` materializes and quantizes each rank's shard, with
every weight initialized to rows of a master that depends only on the weight's full shape, so the
one-GPU model starts from the same values.

Every rank feeds the same batch, so FSDP2's averaged gradient equals the one-GPU gradient (at
2 ranks bit for bit: (g + g) / 2 = g). Compared on every rank, at each of 4 points (before the
first step and after each of 3 optimizer steps): every parameter after the gather (every buffer TE
holds, and TE's dequantize()) and the loss and output, bit for bit against the one-GPU model.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch

from qgather.errors import HarnessFault
from qgather.formats import FORMATS, FormatError
from qgather.impls.te.environment import recipe_unavailable_reason
from qgather.impls.te.recipes import make_recipe
from qgather.instruments.compare import compare_values
from qgather.instruments.digest import digest
from qgather.instruments.patches import hooks_moving_phase
from qgather.model.case import CaseSpec, ShardLayout
from qgather.model.phases import Phase, PhaseTracker
from qgather.model.records import BufferDiff, Comparison, DiffProblem, RankResult, Stage

MODEL_STEPS = 3
SEQUENCE, BATCH = 16, 2
LEARNING_RATE = 1e-3


def run_model_case(route, ctx, spec: CaseSpec, phases: PhaseTracker) -> RankResult:
    # TE picks deterministic attention kernels only when asked; nondeterministic backward kernels
    # would make the one-GPU comparison meaningless.
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    hidden, ffn = spec.shape
    x = _batch(spec, hidden, ctx.device)
    with phases.at(Phase.BUILD):
        single = _build(route, spec, hidden, ffn, rank=0, world_size=1)
        _reset(single)
        single_run = list(_train(route, spec, single, x, phases=None))
    with phases.at(Phase.SHARD):
        sharded = _build(route, spec, hidden, ffn, rank=ctx.rank, world_size=ctx.world_size)
        _shard(sharded, ctx.mesh)
        _reset(sharded)
    stages = []
    for point, (params, output) in enumerate(_train(route, spec, sharded, x, phases)):
        want_params, want_output = single_run[point]
        with phases.at(Phase.INSPECTION):
            stages.append(_stage(route, spec, point, params, want_params, output, want_output))
    return RankResult(ctx.rank, tuple(stages), None, None)


# ------------------------------------------------------------------ building
class TinyTEModel(torch.nn.Module):
    def __init__(self, te, hidden: int, ffn: int, dtype: torch.dtype, init, out_init) -> None:
        super().__init__()
        common = {"params_dtype": dtype, "device": "meta"}
        self.proj = te.LayerNormLinear(hidden, hidden, bias=True, init_method=init, **common)
        self.mlp = te.LayerNormMLP(hidden, ffn, bias=True, init_method=init, output_layer_init_method=out_init,
                                   **common)
        # fused QKV as TE's FSDP2 tests build it: split parameters cannot be quantized at init
        self.block = te.TransformerLayer(hidden, ffn, hidden // 64, hidden_dropout=0.0, attention_dropout=0.0,
                                         fuse_qkv_params=True, init_method=init, output_layer_init_method=out_init,
                                         **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        h = h + self.mlp(h)
        return self.block(h)


def _build(route, spec: CaseSpec, hidden: int, ffn: int, rank: int, world_size: int) -> TinyTEModel:
    import transformer_engine.pytorch as te  # TE is optional: imported on use

    full_shapes = [(3 * hidden, hidden), (ffn, hidden), (hidden, ffn), (hidden, hidden)]
    init = _rows_of_masters(spec, full_shapes, rank, world_size)
    with te.quantized_model_init(enabled=True, recipe=make_recipe(spec.fmt, route.recipes)):
        return TinyTEModel(te, hidden, ffn, spec.torch_dtype, init, init)


def _rows_of_masters(spec: CaseSpec, full_shapes, rank: int, world_size: int):
    """TE's init_method for every weight of the model: it receives a local shard, writes this rank's
    rows of the master of the full weight the shard belongs to (found by its shape)."""

    def init_method(local: torch.Tensor) -> None:
        matches = {full for full in full_shapes
                   if full[1] == local.shape[-1] and _rows(full[0], rank, world_size) == local.shape[0]}
        if len(matches) != 1:
            raise HarnessFault(f"cannot tell which weight a {tuple(local.shape)} shard belongs to "
                               f"(candidates {sorted(matches)}); choose model sizes whose shards differ")
        full = matches.pop()
        start, end = ShardLayout(full[0], world_size, 1).dim0_range(rank)
        with torch.no_grad():
            local.copy_(_master(spec, full)[start:end].to(local.device, local.dtype))

    return init_method


def _rows(dim0: int, rank: int, world_size: int) -> int:
    start, end = ShardLayout(dim0, world_size, 1).dim0_range(rank)
    return end - start


def _master(spec: CaseSpec, shape: tuple[int, int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(spec.seed * 7919 + shape[0] * 131 + shape[1])
    return torch.randn(shape, generator=generator) * shape[1] ** -0.5


def _batch(spec: CaseSpec, hidden: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(spec.seed + 11)
    return torch.randn((SEQUENCE, BATCH, hidden), generator=generator).to(device, spec.torch_dtype)


def _te_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # TE is optional: on use

    return [m for m in model.modules() if isinstance(m, TransformerEngineBaseModule)]


def _shard(model: TinyTEModel, mesh) -> None:
    from torch.distributed.fsdp import fully_shard  # deferred: listing cases loads this adapter, not FSDP2

    for child in (model.proj, model.mlp, model.block):
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _reset(model: TinyTEModel) -> None:
    with torch.enable_grad():
        for module in _te_modules(model):
            module.reset_parameters()
    for module in _te_modules(model):
        if any(p.is_meta for p in module.parameters(recurse=False)):
            raise HarnessFault(f"{type(module).__name__} still has meta parameters after reset_parameters")


# ------------------------------------------------------------------ training
def _train(route, spec: CaseSpec, model: TinyTEModel, x: torch.Tensor, phases: PhaseTracker | None):
    """Yields (parameters after the gather, output) before the first step and after each step."""
    import transformer_engine.pytorch as te  # TE is optional: imported on use

    recipe = make_recipe(spec.fmt, route.recipes)
    reason = recipe_unavailable_reason(recipe)  # before te.autocast: a refused one leaves FP8 enabled
    if reason:
        raise RuntimeError(reason)
    optimizer = _optimizer(model)
    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    for step in range(MODEL_STEPS + 1):
        params = _gathered_params(route, model, phases)
        with _at(phases, Phase.FORWARD), autocast(enabled=True, recipe=recipe), _bf16_autocast(spec):
            y = model(x)
            loss = y.float().pow(2).mean()
        yield params, torch.cat([loss.detach().reshape(1), y.detach().float().flatten()])
        if step == MODEL_STEPS:
            return
        with _at(phases, Phase.STEP):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _optimizer(model: torch.nn.Module):
    """TE's FusedAdam with fp32 master weights, as TE's FSDP2 example trains quantized weights."""
    from transformer_engine.pytorch.optimizers import FusedAdam  # TE is optional: imported on use

    return FusedAdam(model.parameters(), lr=LEARNING_RATE, master_weights=True)


def _bf16_autocast(spec: CaseSpec):
    # TE's NVFP4 recipe runs under torch.autocast as well (TE 2.20's fsdp2 tests)
    if spec.fmt.startswith("nvfp4"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _at(phases: PhaseTracker | None, phase: Phase):
    return phases.at(phase) if phases is not None else contextlib.nullcontext()


def _gathered_params(route, model: torch.nn.Module, phases: PhaseTracker | None) -> dict[str, dict]:
    """Every parameter of the model as the gather left it: buffers of quantized ones (by TE's
    names), TE's dequantize(), plain values otherwise. Cloned, then the modules are resharded."""

    from torch.distributed.fsdp import FSDPModule  # deferred: listing cases loads this adapter, not FSDP2

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    types = _quantized_types()
    for module in fsdp:
        if phases is None:
            module.unshard()
        else:
            with phases.at(Phase.SHARD), hooks_moving_phase(phases, types):
                module.unshard()
    params = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            params[name] = _snapshot(route, param)
    for module in fsdp:
        module.reshard()
    return params


def _quantized_types() -> tuple[type, ...]:
    # TE is optional: imported on use
    from transformer_engine.pytorch.tensor import Float8BlockwiseQTensor, Float8Tensor, MXFP8Tensor, NVFP4Tensor

    return (Float8Tensor, Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor)


def _snapshot(route, param: torch.Tensor) -> dict:
    local = param._local_tensor if hasattr(param, "_local_tensor") else param
    if local.is_meta:
        raise HarnessFault("a parameter is still on meta after the gather")
    if route.is_quantized(local):
        buffers = {k: v.detach().clone() for k, v in route.read_buffers(local).items()}
        return {"buffers": buffers, "values": local.dequantize(dtype=torch.float32).detach().clone()}
    return {"buffers": {}, "values": local.detach().float().clone()}


# ------------------------------------------------------------------ comparing
def _stage(route, spec: CaseSpec, point: int, got: dict, want: dict, output: torch.Tensor,
           want_output: torch.Tensor) -> Stage:
    label = "before step 1" if point == 0 else f"after step {point}"
    diffs, n_diff, max_abs = [], 0, 0.0
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            diffs.append(_held_only(name, want))
            continue
        valid = _valid_regions(spec.fmt, tuple(want[name]["values"].shape))
        diffs.extend(replace(d, name=f"{name}.{d.name}")
                     for d in _buffer_diffs(got[name]["buffers"], want[name]["buffers"], valid))
        values = compare_values(got[name]["values"], want[name]["values"])
        if not values.equal:
            n_diff, max_abs = n_diff + values.n_diff, max(max_abs, values.max_abs)
            diffs.append(BufferDiff(name, DiffProblem.VALUES, n_diff=values.n_diff, max_abs=values.max_abs))
    return Stage(f"model {label} vs the one-GPU model", quantized=True, digest=_digest(spec, got),
                 buffer_diffs=tuple(diffs), dequantized=Comparison(n_diff == 0, n_diff, max_abs),
                 output=compare_values(output, want_output), output_digest=digest({"output": output}, {}))


def _held_only(name: str, want: dict) -> BufferDiff:
    return BufferDiff(name, DiffProblem.HELD_ONLY, detail="on one GPU" if name in want else "by the sharded model")


def _digest(spec: CaseSpec, params: dict) -> str:
    """What the ranks must agree on: every buffer's valid region (scale padding may hold anything)
    and every dequantized value."""
    buffers, valid = {}, {}
    for name, param in params.items():
        regions = _valid_regions(spec.fmt, tuple(param["values"].shape))
        for buffer, tensor in param["buffers"].items():
            buffers[f"{name}.{buffer}"] = tensor
            if len(regions.get(buffer, ())) == tensor.dim():
                valid[f"{name}.{buffer}"] = regions[buffer]
        buffers[f"{name}.values"] = param["values"]
    return digest(buffers, valid)


def _valid_regions(fmt: str, shape: tuple[int, ...]) -> dict[str, tuple[slice, ...]]:
    """The format's valid region of each buffer (scale padding may hold anything)."""
    try:
        return FORMATS[fmt].valid_regions(shape) if len(shape) == 2 else {}
    except FormatError:
        return {}


def _buffer_diffs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  valid: dict[str, tuple[slice, ...]]) -> list[BufferDiff]:
    diffs = []
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            diffs.append(_held_only(name, want))
        elif got[name].shape != want[name].shape:
            diffs.append(BufferDiff(name, DiffProblem.SHAPE,
                                    detail=f"{tuple(got[name].shape)} != one GPU's {tuple(want[name].shape)}"))
        else:
            region = valid.get(name, ()) if len(valid.get(name, ())) == got[name].dim() else ()
            n = int((got[name][region].view(torch.uint8) != want[name][region].view(torch.uint8)).sum())
            if n:
                diffs.append(BufferDiff(name, DiffProblem.BITS, n_diff=n))  # n_valid 0: counted in bytes
    return diffs
