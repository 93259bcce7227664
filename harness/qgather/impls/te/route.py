"""`te`: TransformerEngine the way its users run FSDP2 (TE 2.20.2's fsdp2 tests and its
quantized_model_init example):

  1. `te.Linear(..., device="meta", init_method=...)` built under
     `te.quantized_model_init(enabled=True, recipe=R)`: plain high-precision meta parameters;
  2. `fully_shard(module, mesh=...)`;
  3. `module.reset_parameters()` under grad mode: each rank materializes its local shard, runs
     `init_method` on it (here: writes exactly this rank's rows of the case's master weight),
     quantizes it with the recipe's weight quantizer (current scaling and NVFP4 all-reduce the
     amax over the shard group first) and installs it with `DTensor.from_local`.

Under tensor parallelism (`tp-DxT[-row]`) TE's own TP applies, not torch's styles: te.Linear is
built with `tp_group` (the "tp" mesh's group), `tp_size` and `parallel_mode` ("column" for tp-DxT,
"row" for tp-DxT-row), so each rank's module holds its TP piece, and `fully_shard` on "dp" shards
that piece; TE's reset_parameters reduces the amax over the mesh FSDP2 put on the parameter.

The gathers then go through TE's own `fsdp_pre_all_gather` / `fsdp_post_all_gather`, and the
steps/reshard scenarios re-quantize the sharded parameter in place with `quantize_`, as TE's
optimizers do with master weights.

On GPUs without TE's NVFP4 kernels (below sm_100) the module's weight quantizer is replaced by a
subclass of TE's NVFP4Quantizer that builds each shard's NVFP4Tensor from the harness's reference
bits with the all-reduced amax; everything else (reset_parameters, hooks) is TE's code. The case
report says so.
"""

from __future__ import annotations

import importlib

import torch

from qgather.errors import HarnessFault
from qgather.formats.numerics import FP8_E4M3_MAX
from qgather.impls.base import NoSingleDeviceTwin
from qgather.impls.te.adapter import NVFP4, TEAdapter
from qgather.impls.te.environment import has_nvfp4_kernels, recipe_unavailable_reason, sm_name
from qgather.impls.te.model import run_model_case
from qgather.impls.te.recipes import NOT_ON_THIS_ROUTE, RECIPES, make_recipe
from qgather.impls.te.tensors import read_te_buffers
from qgather.model.case import CaseSpec, saved_spec, tensor_parallel_layout
from qgather.model.records import RankResult
from qgather.model.tp_rank import TensorParallelRank


class TransformerEngineRoute(TEAdapter):
    name = "te"
    recipes = RECIPES
    formats = (*RECIPES, *NOT_ON_THIS_ROUTE)
    scenarios = ("gather", "steps", "reshard", "model", "block")
    reads_own_rows_only = True  # make_sharded_module writes only setup.master_slice(master) (`_writes`)

    def route_skip_reason(self, spec: CaseSpec) -> str | None:
        if spec.fmt in NOT_ON_THIS_ROUTE and spec.fmt not in self.recipes:
            return f"{self.name}: {NOT_ON_THIS_ROUTE[spec.fmt]}"
        if spec.scenario == "model" and spec.fmt in NVFP4 and not has_nvfp4_kernels():
            return f"{self.name}: the model trains with TE's NVFP4 GEMMs, which need sm_100 (this GPU is {sm_name()})"
        return None

    def run_model(self, ctx, spec: CaseSpec, phases) -> RankResult:
        return run_model_case(self, ctx, spec, phases)

    def make_sharded_module(self, ctx, spec: CaseSpec, master: torch.Tensor, setup) -> torch.nn.Module:
        """The case's configuration applies as a TE user writes it: `fully_shard(module, mesh=...,
        mp_policy=..., reshard_after_forward=..., shard_placement_fn=...)` before reset_parameters
        (which reduces the amax over the mesh's "shard" dimension under HSDP). `setup` is the
        scenario's qgather.scenarios.fsdp_setup.Setup, handed in as a value."""
        _check_no_leaked_autocast()
        # No name here keeps the rows: init_method lets go of them once written, before TE quantizes the
        # shard (they are a copy where the master's device or dtype differs from the case's).
        module = self._linear_on_meta(spec, setup.master_slice(master).to(device=ctx.device, dtype=spec.torch_dtype),
                                      tp=setup.tp)
        from torch.distributed.fsdp import fully_shard  # deferred: listing cases loads this adapter, not FSDP2

        fully_shard(module, **setup.kwargs)
        with torch.enable_grad():
            module.reset_parameters()
        return module

    def make_block_layer(self, ctx, spec: CaseSpec, master: torch.Tensor, setup) -> torch.nn.Module:
        """A te.Linear of the block scenario's one fully_shard group: built on meta under
        quantized_model_init as in make_sharded_module, but sharded by the block's fully_shard (with
        the block's other layers and plain parameters); `materialize_block_layer` then runs its
        reset_parameters, which writes and quantizes this rank's rows."""
        _check_no_leaked_autocast()
        rows = setup.master_slice(master).to(device=ctx.device, dtype=spec.torch_dtype)
        return self._linear_on_meta(spec, rows, tp=setup.tp)

    def materialize_block_layer(self, module: torch.nn.Module) -> None:
        with torch.enable_grad():
            module.reset_parameters()

    def config_skip_reason(self, spec: CaseSpec) -> str | None:
        if spec.config.compile:
            return (f"{self.name}: te.Linear's forward runs with torch._dynamo disabled (TE 2.20's @no_torch_dynamo, "
                    "transformer_engine/pytorch/jit.py): torch.compile captures no graph of it")
        if spec.config.saved_after_forward:
            reason = fp8_forward_refusal(saved_spec(spec)) or recipe_unavailable_reason(
                make_recipe(spec.fmt, self.recipes))
            if reason:
                return f"{self.name}: the training forward before the save cannot run here: TE: {reason}"
        return None

    def forward_context(self, spec: CaseSpec):
        """te.autocast with the case's recipe; raises TE's own reason, without entering it, where
        the GPU cannot run the recipe (see environment.recipe_unavailable_reason)."""
        import transformer_engine.pytorch as te  # TE is optional: imported on use

        recipe = make_recipe(spec.fmt, self.recipes)
        reason = recipe_unavailable_reason(recipe)
        if reason:
            raise RuntimeError(reason)
        autocast = getattr(te, "autocast", None) or te.fp8_autocast
        return autocast(enabled=True, recipe=recipe)

    def single_device_output(self, spec: CaseSpec, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The same te.Linear and recipe on this GPU alone, initialized with the full weight (so the
        recipe's amax is the full weight's, as the all-reduced one is on the sharded route)."""
        reason = recipe_unavailable_reason(make_recipe(spec.fmt, self.recipes))
        if reason:  # the forward would refuse: not worth a full-size module first
            raise RuntimeError(reason)
        dtype = spec.torch_dtype
        if x.dtype != dtype:  # a mixed-precision policy: the sharded layer computes in x's dtype
            lifted = weight.to(x.dtype)
            if not torch.equal(lifted.to(dtype), weight):
                raise NoSingleDeviceTwin(
                    f"the sharded layer quantized {dtype} masters and computes in {x.dtype}; a one-device te.Linear "
                    f"computes in its params_dtype, and these masters are not exactly representable in {x.dtype}")
            weight, dtype = lifted, x.dtype  # the same values, so TE quantizes them to the same bits
        # the rows stay where they are (a large weight on the host): TE's init_method copies them in
        module = self._linear_on_meta(spec, weight.to(dtype=dtype), dtype)
        with torch.enable_grad():
            module.reset_parameters()
        return self.module_output(spec, module, x)

    def module_output(self, spec: CaseSpec, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """TE's forward of the module under te.autocast with the case's recipe (the unsharded
        weight as FSDP2 left it after the gather)."""
        with torch.no_grad(), self.forward_context(spec):
            return module(x).float()

    def _linear_on_meta(self, spec: CaseSpec, rows: torch.Tensor, dtype: torch.dtype | None = None,
                        tp: TensorParallelRank | None = None) -> torch.nn.Module:
        import transformer_engine.pytorch as te  # TE is optional: imported on use

        out_features, in_features = spec.shape
        with te.quantized_model_init(enabled=True, recipe=make_recipe(spec.fmt, self.recipes)):
            module = te.Linear(in_features, out_features, bias=False, params_dtype=dtype or spec.torch_dtype,
                               device="meta", init_method=_writes(rows), **_tensor_parallel_kwargs(tp))
        if spec.fmt in NVFP4 and not has_nvfp4_kernels():
            _install_reference_bits_quantizer(module, spec.fmt)
        return module


def fp8_forward_refusal(spec: CaseSpec) -> str | None:
    """Why te.Linear's forward under te.autocast refuses the case's weight (any recipe), or None: TE
    2.20's assert_dim_for_fp8_exec (module/linear.py, `if fp8:`) wants the weight's rows a multiple of 8
    and its K a multiple of 16 (the input's rows, qgather's 8, always are). The weight the forward
    receives is the unsharded one, a TP rank's piece under tensor parallelism."""
    tp = tensor_parallel_layout(spec)
    rows, cols = tp.piece_shape() if tp is not None else (spec.shape[0], spec.shape[-1])
    if rows % 8 == 0 and cols % 16 == 0:
        return None
    return (f"te.Linear's FP8 forward refuses a {rows}x{cols} weight (assert_dim_for_fp8_exec: rows a multiple "
            f"of 8, K a multiple of 16)")


def _tensor_parallel_kwargs(tp: TensorParallelRank | None) -> dict:
    """TE's own tensor parallelism for a tp-DxT case, as Megatron-style TE users write it: te.Linear
    takes the global sizes and the "tp" process group and holds only its piece (column: out / T
    rows, Shard(0); row: in / T columns, Shard(1)); fully_shard on "dp" then shards that piece."""
    if tp is None:
        return {}
    return {"tp_group": tp.mesh.get_group(), "tp_size": tp.layout.size,
            "parallel_mode": "row" if tp.rowwise else "column", "sequence_parallel": False}


def _check_no_leaked_autocast() -> None:
    """TE reads its global FP8 state when a module is built (e.g. whether `_extra_state` will be
    saved): a state left enabled by an earlier case on this rank would change this case."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # TE is optional: imported on use

    if FP8GlobalStateManager.is_fp8_enabled() or FP8GlobalStateManager.with_fp8_parameters():
        raise HarnessFault("TE's global FP8 state is still enabled on this rank when the case starts "
                           "(te.autocast or quantized_model_init left open by an earlier case)")


def _writes(rows: torch.Tensor):
    """TE's init_method for the weight: write this rank's part of the master weight (its rows; its
    columns under Shard(1)) into the local shard TE materialized (a shard of any other shape means
    FSDP2 split differently than the harness's golden assumes). It lets go of the rows once written:
    the module keeps its init_method, and the rows are a view of the case's full weight."""
    held = [rows]

    def init_method(local: torch.Tensor) -> None:
        if not held:
            raise HarnessFault("TE called the weight's init_method a second time; "
                               "the harness writes the master rows once")
        source = held.pop()
        if tuple(local.shape) != tuple(source.shape):
            raise HarnessFault(f"TE's reset_parameters handed init_method a local shard of shape "
                               f"{tuple(local.shape)}; this rank's part of the master weight is {tuple(source.shape)}")
        with torch.no_grad():
            local.copy_(source)

    return init_method


def _install_reference_bits_quantizer(module: torch.nn.Module, fmt: str) -> None:
    from qgather.impls.te.reference_bits import ReferenceBitsNVFP4Quantizer  # subclasses a TE class: imports TE

    index = module.param_init_meta["weight"].fp8_meta_index
    original = module.quantizers["scaling_fwd"][index]
    module.quantizers["scaling_fwd"][index] = ReferenceBitsNVFP4Quantizer.replacing(original, fmt)


class DelayedScalingRoute(TransformerEngineRoute):
    """`te:delayed`: the same route with DelayedScaling. At reset_parameters the weight quantizer's
    scale is the fp8_meta's initial 1 (no amax history yet), and it stays so until a forward under
    te.autocast updates it; the golden is the reference FP8 format at that scale."""

    name = "te:delayed"
    recipes = {"fp8_tensor": ("DelayedScaling", {})}
    formats = ("fp8_tensor",)

    def reference_quantize(self, fmt, weight: torch.Tensor):
        # current scaling with amax = fp8_max is exactly scale 1 (scale = fp8_max / amax)
        return fmt.quantize(weight, amax=torch.tensor(FP8_E4M3_MAX, device=weight.device))

    def own_quantization(self, fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformer_engine.pytorch.tensor import Float8Quantizer  # TE is optional: imported on use

        # the extension is importable only after transformer_engine.pytorch has loaded it
        tex = importlib.import_module("transformer_engine_torch")

        x = weight.cuda()
        quantizer = Float8Quantizer(scale=torch.ones(1, device=x.device), amax=torch.zeros(1, device=x.device),
                                    fp8_dtype=tex.DType.kFloat8E4M3)
        return read_te_buffers(quantizer(x))
