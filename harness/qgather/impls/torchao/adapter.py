"""torchao float8 training: `Float8LinearConfig(enable_fsdp_float8_all_gather=True)` under FSDP2.

What is under test is torchao's own code path, unchanged:
- `convert_to_float8_training(nn.Linear(K, M, bias=False))` wraps the weight in
  `WeightWithDynamicFloat8CastTensor` (torchao/float8/fsdp_utils.py), which keeps the
  high-precision master shard and casts it to float8 (E4M3, tensorwise dynamic scaling) in its
  `fsdp_pre_all_gather`, with the amax all-reduced over the FSDP mesh (`reduce_amax=True`), or with
  the scale set by `precompute_float8_dynamic_scale_for_fsdp` (variant `torchao:precompute`);
- the all-gather moves the float8 bits; `fsdp_post_all_gather` builds a `Float8TrainingTensor`
  (`_data` float8 (M, K), `_scale` float32 0-d, the multiplier from high precision to float8).

Mapping to the harness's `fp8_tensor` buffers (TransformerEngine names): `data` = `_data` viewed
as uint8, `scale_inv` = `_scale.reciprocal()` as float32 (1,) (torchao's matmul hands exactly
this reciprocal to `torch._scaled_mm`, float8_ops.py `addmm_float8_unwrapped`).

Only torchao's float8 collective needs help on CPU: gloo rejects float8 dtypes in all-gather, so
`gather_context` enters `qgather.impls.torchao.transport.float8_as_bytes_on_gloo`, which hands the same bytes to
gloo as uint8 (inactive on NCCL, which gathers float8 natively). Nothing torchao computes changes.

Layer output (`forward`): `x @ W^T` with W dequantized the way torchao's matmul applies the scale,
`_data * _scale.reciprocal()` (float8_ops.py hands that reciprocal to `torch._scaled_mm`), on every
device. torchao's own `to_original_precision()` divides instead (`_data / _scale`), which differs in
the last bit for some elements (499 of 4096 for one fp32 weight): a property of torchao's
dequantization helper, not of its all-gather, so it is not what the layer comparison judges.
torchao's real `Float8Linear.forward` cannot be compared bit for bit with the golden layer: it
casts the activation to float8 as well and multiplies in `torch._scaled_mm` (no CPU kernel); on an
H200 its output differed from the golden `x @ W^T` in 467 of 512 elements (max 36 on outputs up
to 792) with bit-exact gathered buffers. So on CUDA the real forward runs too, as a check: it must
agree with the returned output within float8 activation rounding, else the case fails (REJECTED,
with the numbers), which catches a gathered `_scale` that torchao's matmul would misuse.

Tensor parallelism (`tp-DxT[-row]`): torchao's own Float8ColwiseParallel / Float8RowwiseParallel
distribute the converted weight on "tp" before fully_shard on "dp", as torchao's FSDP2 + TP test
(test/float8/test_fsdp2_tp.py) does. Its pre-hook reduces the amax over the mesh FSDP2 hands it,
the "dp" one: each TP piece is cast with its own scale unless the scale is precomputed
(`torchao:precompute`, whose all-reduce runs over the whole 2-D DTensor): docs/findings.md.

Scenarios: `gather`, `steps`, `reshard`, `layers` (a module of several Float8Linear layers, whose
precomputed scales `precompute_float8_dynamic_scale_for_fsdp` computes in one all-reduce for all of
them). `hooks` and `virtual` are skipped with the reasons in `skip_reason` (torchao's legacy
one-argument hook signature; an amax all-reduce that one process cannot emulate). 3-D expert weights
are skipped (a layers module leaves its expert weight out): torchao has no float8 all-gather for them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from qgather.impls.base import Implementation
from qgather.impls.torchao.transport import float8_as_bytes_on_gloo
from qgather.model.case import CaseSpec

FORMAT = "fp8_tensor"  # per-tensor current scaling, E4M3: what torchao's tensorwise recipe is

SKIP_3D = (
    "torchao has no float8 all-gather for 3-D expert weights: its float8 FSDP2 hooks "
    "(WeightWithDynamicFloat8CastTensor) exist only for Float8Linear's 2-D weight, and its MoE "
    "weights (torchao.prototype.moe_training ScaledGroupedMMTensor) all-gather in high precision"
)
SKIP_HOOKS = (
    "torchao's WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather(self, mesh) has FSDP2's legacy "
    "one-argument signature; the hooks scenario calls the five-argument one"
)
SKIP_VIRTUAL = (
    "torchao's scale needs a collective over a real mesh: fsdp_pre_all_gather all-reduces the amax "
    "over device_mesh.get_group() (float8_utils.tensor_to_amax), precompute_float8_dynamic_scale_for_fsdp "
    "all-reduces it through the FSDP2-sharded DTensor weight; one process emulating the ranks has "
    "neither (without them each virtual rank would scale by its own shard's amax, which torchao never does)"
)


#: torch._scaled_mm multiplies float8 matrices whose dims are multiples of this, on CUDA
SCALED_MM_MULTIPLE = 16


def _torchao():
    """torchao's float8 API, imported on first use (the module imports without torchao)."""
    # torchao is optional: imported on use
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig
    from torchao.float8.fsdp_utils import (
        WeightWithDynamicFloat8CastTensor,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    return {
        "Float8LinearConfig": Float8LinearConfig,
        "convert_to_float8_training": convert_to_float8_training,
        "Float8Linear": Float8Linear,
        "hp_tensor_to_float8_dynamic": hp_tensor_to_float8_dynamic,
        "Float8TrainingTensor": Float8TrainingTensor,
        "GemmInputRole": GemmInputRole,
        "LinearMMConfig": LinearMMConfig,
        "WeightWithDynamicFloat8CastTensor": WeightWithDynamicFloat8CastTensor,
        "precompute": precompute_float8_dynamic_scale_for_fsdp,
        "Float8ColwiseParallel": Float8ColwiseParallel,
        "Float8RowwiseParallel": Float8RowwiseParallel,
    }


def torchao_available() -> bool:
    try:
        _torchao()
    except ImportError:
        return False
    return True


class TorchaoFloat8(Implementation):
    """torchao Float8Linear, tensorwise dynamic scaling, float8 all-gather (no precomputed scale)."""

    name = "torchao"
    formats = (FORMAT,)
    rank_imports = ("qgather.impls.torchao.rank_import",)
    scenarios = ("gather", "steps", "reshard", "layers", "block")
    #: whether precompute_float8_dynamic_scale_for_fsdp runs before each unshard (as a training
    #: loop calls it after each optimizer step)
    precompute = False
    #: on CUDA, also run the real Float8Linear.forward (torch._scaled_mm) and bound its difference
    check_real_forward = True

    def __init__(self) -> None:
        self._module: torch.nn.Module | None = None  # the current case's (last built) Float8Linear
        self._built: list[weakref.ref] = []  # every Float8Linear built and still alive (a case may build several)
        self._precompute_pending = False

    # ------------------------------------------------------------------ selection
    def skip_reason(self, spec: CaseSpec, device: torch.device) -> str | None:
        if spec.fmt not in self.formats:
            return (f"{self.name} implements only {FORMAT} (torchao's tensorwise float8 all-gather, E4M3), "
                    f"not {spec.fmt}")
        if spec.scenario == "hooks":
            return f"{self.name}: {SKIP_HOOKS}"
        if spec.scenario == "virtual":
            return f"{self.name}: {SKIP_VIRTUAL}"
        reason = super().skip_reason(spec, device)
        if reason:
            return reason
        if len(spec.shape) != 2:
            return f"{self.name}: {SKIP_3D}"
        if not torchao_available():
            return f"{self.name}: torchao is not installed (pip install torchao)"
        return self._forward_refusal(spec, device)

    def _forward_refusal(self, spec: CaseSpec, device: torch.device) -> str | None:
        """A case that needs torchao's own Float8Linear forward (a compiled case; a trained checkpoint's
        forward before the save) where torch._scaled_mm refuses the weight: the layer's GEMM constraint,
        with or without FSDP2, so the configuration cannot run here (CPU emulates the GEMM)."""
        if device.type != "cuda" or not any(d % SCALED_MM_MULTIPLE for d in spec.shape):
            return None
        if spec.config.compile:
            needs = "the compiled case runs torchao's own Float8Linear forward"
        elif spec.config.saved_after_forward:
            needs = "the training forward before the save runs torchao's own Float8Linear forward"
        else:
            return None
        return (f"{self.name}: {needs}, whose torch._scaled_mm multiplies only dims that are multiples of "
                f"{SCALED_MM_MULTIPLE} on CUDA (a GEMM constraint of the layer, not of its all-gather; torchao's "
                f"users filter such layers out)")

    # ------------------------------------------------------------------ construction
    def config(self):
        return _torchao()["Float8LinearConfig"](enable_fsdp_float8_all_gather=True)

    def make_module(self, fmt: str, weight: torch.Tensor) -> torch.nn.Module:
        ao = _torchao()
        out_features, in_features = weight.shape
        linear = torch.nn.Linear(in_features, out_features, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
        linear.weight.requires_grad_(False)
        module = ao["convert_to_float8_training"](linear, config=self.config())
        if not isinstance(module.weight, ao["WeightWithDynamicFloat8CastTensor"]):
            raise TypeError(f"{self.name}: convert_to_float8_training did not wrap the weight for float8 "
                            f"all-gather (got {type(module.weight).__name__})")
        self._module = module
        self._built = [ref for ref in self._built if ref() is not None] + [weakref.ref(module)]
        self._precompute_pending = self.precompute
        return module

    def tensor_parallel_style(self, rowwise: bool):
        """torchao's own styles (torchao.float8.float8_tensor_parallel), as its FSDP2 + TP users apply
        them after convert_to_float8_training: they distribute the weight as torch's do and cast the
        activations to float8 in the layer's input hooks."""
        ao = _torchao()
        return ao["Float8RowwiseParallel"]() if rowwise else ao["Float8ColwiseParallel"]()

    def make_param(self, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        """The wrapped full weight, as convert_to_float8_training builds it (hooks/virtual only)."""
        return self.make_module(fmt, weight).weight

    # ------------------------------------------------------------------ reading a gathered weight
    def is_quantized(self, param: torch.Tensor) -> bool:
        return isinstance(param, _torchao()["Float8TrainingTensor"])

    def read_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        data, scale = param._data, param._scale
        if scale.numel() != 1:
            raise TypeError(f"{self.name}: expected a tensorwise scale, got shape {tuple(scale.shape)}")
        # Copies (bit-identical): the harness digests the buffers through numpy, and
        # Tensor.numpy() makes a CPU storage non-resizable, after which FSDP2's reshard
        # (free_storage -> resize_(0)) of the all-gather output would fail.
        return {
            "data": data.view(torch.uint8).clone(memory_format=torch.contiguous_format),
            "scale_inv": scale.to(torch.float32).reciprocal().reshape(1).clone(),
        }

    def own_quantization(self, fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """torchao's own cast of the full weight on one device (what every rank's pre-hook would
        compute if it held the whole weight): hp_tensor_to_float8_dynamic, no amax reduction."""
        ao = _torchao()
        config = self.config()
        fp8 = ao["hp_tensor_to_float8_dynamic"](
            weight,
            config.cast_config_weight.target_dtype,
            ao["LinearMMConfig"](),
            reduce_amax=False,
            gemm_input_role=ao["GemmInputRole"].WEIGHT,
        )
        return self.read_buffers(fp8)

    def forward(self, param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # The scale as torchao's matmul applies it (see the module docstring).
        weight = (param._data.to(torch.float32) * param._scale.to(torch.float32).reciprocal()).to(param._orig_dtype)
        y = torch.matmul(x, weight.transpose(-1, -2))
        if param.device.type == "cuda" and self.check_real_forward:
            self._check_real_forward(param, x, weight, y)
        return y

    def _check_real_forward(self, param, x, weight, y) -> None:
        """torchao's real layer on the gathered weight, called unbound so that FSDP2's forward hooks
        do not run. It rounds x to float8 (E4M3: relative error <= 2^-4, absolute <= 2^-10 * amax(x) / 448
        for subnormals), so each output may differ from x @ W^T by up to ~2^-4 * sum_k |x_k w_k|; the
        bound allows twice that, the subnormal term and the rounding of the output dtype. A misused
        scale (a factor of 2 or more) is far outside it.

        Not run for a weight torch._scaled_mm cannot multiply (a dim not a multiple of 16): that is the
        GEMM's constraint, which torchao's layer has with or without FSDP2 (its users filter such layers
        out of float8 training), not the all-gather's; the gathered weight is judged all the same (its
        buffers, values and x @ W^T). docs/findings.md, "Not findings"."""
        from torch.distributed.tensor import DTensor  # loaded by FSDP2 by now; not when listing cases

        if any(dim % SCALED_MM_MULTIPLE for dim in param.shape[-2:]):
            return

        modules = [m for m in (ref() for ref in self._built) if m is not None]
        if any(isinstance(m.weight, DTensor) and m.weight._local_tensor is param for m in modules):
            return  # tp-DxT: the layer's forward needs the TP style's DTensor input; x @ W_piece^T is compared
        module = next((m for m in modules if m.weight is param), None)
        if module is None:
            raise RuntimeError(f"{self.name}: the gathered weight is no built Float8Linear's weight")
        y_real = _torchao()["Float8Linear"].forward(module, x).float()
        w_abs = weight.abs().float().transpose(-1, -2)
        bound = (2.0**-3 * (x.abs().float() @ w_abs) + 2.0**-6 * y.abs().float()
                 + 2.0**-9 * float(x.abs().max()) / 448.0 * w_abs.sum(0))
        bad = (y_real - y.float()).abs() > bound
        if bool(bad.any()):
            diff = (y_real - y.float()).abs()
            raise RuntimeError(
                f"{self.name}: torchao's real Float8Linear forward on CUDA differs from x @ W^T of its gathered "
                f"weight beyond float8 activation rounding in {int(bad.sum())} of {bad.numel()} outputs "
                f"(max |diff| {float(diff.max()):.4g}, bound there {float(bound.flatten()[diff.argmax()]):.4g})"
            )

    # ------------------------------------------------------------------ steps
    def requantize_shard(self, local: torch.Tensor, master_rows: torch.Tensor, group) -> None:
        """torchao keeps the high-precision shard and re-casts it at every all-gather: an optimizer
        step only writes the new master rows into the wrapper's shard."""
        if not isinstance(local, _torchao()["WeightWithDynamicFloat8CastTensor"]):
            raise TypeError(f"{self.name}: the local shard is a {type(local).__name__}, "
                            "not a WeightWithDynamicFloat8CastTensor")
        if tuple(local.shape) != tuple(master_rows.shape):
            raise ValueError(f"{self.name}: local shard {tuple(local.shape)} != master rows {tuple(master_rows.shape)}")
        with torch.no_grad():
            local._tensor.copy_(master_rows)

    def after_step(self, module: torch.nn.Module, group) -> None:
        if self.precompute:
            _torchao()["precompute"](module)
            self._precompute_pending = False

    def gather_context(self, group) -> contextlib.AbstractContextManager:
        return self._gather(group)

    @contextlib.contextmanager
    def _gather(self, group) -> Iterator[None]:
        if self._precompute_pending and self._module is not None:
            # Before the first unshard, as a training loop that precomputes after every optimizer
            # step would have done after the previous step (fully_shard has run by now).
            _torchao()["precompute"](self._module)
            self._precompute_pending = False
        with float8_as_bytes_on_gloo(group):
            yield


class TorchaoFloat8Precompute(TorchaoFloat8):
    """The same, with precompute_float8_dynamic_scale_for_fsdp setting the scale for each all-gather."""

    name = "torchao:precompute"
    precompute = True


FACTORIES = {"torchao": TorchaoFloat8, "torchao:precompute": TorchaoFloat8Precompute}

__all__ = ["FACTORIES", "TorchaoFloat8", "TorchaoFloat8Precompute", "torchao_available"]
