"""Scenarios: what each rank does with the implementation's quantized weight, and what it checks.

Every rank builds the same full weight from the case seed, quantizes the golden on its own
device with the harness's reference formats, runs the scenario, and returns typed records
(qgather.model.records: digests, differences, wire counts); the verdict is decided from all ranks'
results in `qgather.model.verdict`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from inspect import signature

import torch
import torch.distributed as dist

from qgather.check.compare import compare_buffers, compare_value_blocks, compare_values, digest, locate
from qgather.check.patches import hooks_moving_phase
from qgather.check.wire import record_wire, summarize_wire
from qgather.formats import FORMATS, Format, FormatError, QuantizedTensor
from qgather.formats.base import flat_dims
from qgather.impls import get_impl
from qgather.impls.base import HarnessFault, Implementation, NoSingleDeviceTwin
from qgather.model.case import CaseSpec, ShardLayout, shard_layout
from qgather.model.phases import Phase, PhaseTracker
from qgather.model.records import BufferDiff, Comparison, ModuleCheck, RankResult, Stage
from qgather.scenarios import fsdp_setup

STEPS = 3
LEARNING_RATE = 0.05
INPUT_ROWS = 8


# ------------------------------------------------------------------ deterministic data
#: Weights up to this many elements come from torch's CPU generator, identical on every rank and machine
#: (the stored goldens and every known-issue entry are defined by them). Larger ones (the GPU benchmark's
#: 8192x28672) are drawn on the rank's device: torch's CPU generator alone takes seconds for them. A
#: device's generator gives every rank of one run the same weight (same seed, same GPU model); a CPU run
#: and a GPU run of such a case hold different weights.
LARGE_WEIGHT = 1 << 22


def _generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn_scaled(spec: CaseSpec, seed: int, device, dtype: torch.dtype) -> torch.Tensor:
    """randn(shape) * row_scales, in `dtype` (each value rounded once, from float32)."""
    device = torch.device(device or "cpu")
    if math.prod(spec.shape) <= LARGE_WEIGHT or device.type == "cpu":
        values = torch.randn(spec.shape, generator=_generator(seed)) * row_scales(spec)
        return values.to(device=device, dtype=dtype)
    # Row by row blocks from one device generator: the float32 draw never exists at full size.
    out = torch.empty(spec.shape, dtype=dtype, device=device)
    generator, scales = _generator(seed, device), row_scales(spec, device)
    step = max(1, LARGE_WEIGHT // max(1, math.prod(spec.shape[1:])))
    for start in range(0, spec.shape[0], step):
        rows = out[start:start + step]
        block = torch.randn(rows.shape, generator=generator, device=device)
        rows.copy_(block.mul_(scales[start:start + step]))
    return out


def row_scales(spec: CaseSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """Magnitudes that differ by ~2^12 from the first to the last rows, so shards have very
    different amaxes and a per-rank scale (bug class 6) cannot go unnoticed."""
    exponents = torch.linspace(-6.0, 6.0, spec.shape[0])
    return torch.exp2(exponents).reshape(-1, *([1] * (len(spec.shape) - 1))).to(device or "cpu")


def make_weight(spec: CaseSpec, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The master weight (default float32; `dtype`: the same values rounded to it) on `device`
    (default the CPU), identical on every rank."""
    return _randn_scaled(spec, spec.seed, device, dtype)


def make_gradient(spec: CaseSpec, step: int, device: torch.device | str | None = None) -> torch.Tensor:
    return _randn_scaled(spec, spec.seed * 1000 + step, device, torch.float32)


def make_input(spec: CaseSpec) -> torch.Tensor:
    return torch.randn((INPUT_ROWS, spec.shape[-1]), generator=_generator(spec.seed + 7))


# ------------------------------------------------------------------ the module under FSDP2
class QuantizedLinear(torch.nn.Module):
    """A bias-free linear layer whose weight is the implementation's quantized parameter."""

    def __init__(self, impl: Implementation, weight: torch.Tensor) -> None:
        super().__init__()
        self.impl = impl
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.impl.forward(self.weight, x)


@dataclass
class Golden:
    """What the gathered weight must equal. For an implementation with its own quantizer that is
    its own single-device quantization of the full weight (sharding invariance: gathering the
    shards gives q(W)); its agreement with the reference formats is judged apart
    (`quantizer_diffs`, QUANTIZER_MISMATCH)."""

    q: QuantizedTensor | None
    error: str | None
    fmt: Format | None = None  # the format that dequantizes q
    source: str = "reference formats"
    quantizer_diffs: tuple[BufferDiff, ...] | None = None  # own quantizer vs reference; None: no own quantizer
    _whole: torch.Tensor | None = field(default=None, repr=False)

    def dequantized_blocks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """The golden's float32 values as (rows, block) over the flattened (M, K) weight: one block
        (computed once, kept) up to the format's block size, else row blocks computed as they are
        asked for, so that a large golden is never held dequantized whole."""
        m, _ = flat_dims(self.q.shape)
        blocks = self.fmt.row_blocks(self.q.shape)
        if len(blocks) == 1:
            if self._whole is None:
                self._whole = self.fmt.dequantize(self.q).reshape(m, -1)
            yield slice(0, m), self._whole
            return
        for start, stop in blocks:
            yield slice(start, stop), self.fmt.dequantize_rows(self.q, start, stop)

    def dequantized_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The golden's values rounded to `dtype`, in the weight's shape."""
        m, k = flat_dims(self.q.shape)
        out = torch.empty((m, k), dtype=dtype, device=self.q.device)
        for rows, values in self.dequantized_blocks():
            out[rows] = values
        return out.reshape(self.q.shape)


def golden_for(fmt: Format, weight: torch.Tensor, impl: Implementation | None = None) -> Golden:
    try:
        ref = impl.reference_quantize(fmt, weight) if impl is not None else fmt.quantize(weight)
    except FormatError as exc:
        return Golden(None, str(exc))
    except NotImplementedError:
        ref = None  # a format registered with its layout only: no reference quantizer in qgather
    own = impl.own_quantization(fmt.name, weight) if impl is not None else None
    if ref is None:
        return _own_golden_only(fmt, weight, impl, own)
    if own is None:
        return Golden(ref, None, fmt)
    diffs = tuple(compare_buffers(own, ref))
    if any(d.problem.breaks_layout for d in diffs):
        # Its own quantization does not even have the format's layout: judge against the reference.
        return Golden(ref, None, fmt, quantizer_diffs=diffs)
    buffers = {name: own[name].to(t.device) for name, t in ref.buffers.items()}
    q = QuantizedTensor(fmt.name, ref.shape, buffers, ref.valid)
    return Golden(q, None, fmt, f"{impl.name}'s own quantizer", diffs)


def _own_golden_only(fmt: Format, weight: torch.Tensor, impl: Implementation | None, own) -> Golden:
    """A format without a reference quantizer is still testable: sharding invariance against the
    implementation's own q(W), in the format's layout (valid regions, dequantization)."""
    if own is None:
        name = impl.name if impl is not None else "the harness"
        raise HarnessFault(f"format {fmt.name} has no reference quantizer and {name} no own quantization: "
                           "there is nothing to judge the gather against")
    shape = tuple(weight.shape)
    q = QuantizedTensor(fmt.name, shape, dict(own), fmt.valid_regions(shape))
    return Golden(q, None, fmt, f"{impl.name}'s own quantizer (no reference quantizer)")


# ------------------------------------------------------------------ inspection of a gathered weight
IDENTICAL_BUFFERS = "the same dequantization of bit-identical buffers"


def inspect(
    impl: Implementation,
    fmt: Format,
    param: torch.Tensor,
    golden: Golden,
    x: torch.Tensor,
    shards: ShardLayout,
    label: str,
    dtype: torch.dtype | None = None,
) -> Stage:
    """Compare one gathered (unsharded) weight with the golden, and its dtype with `dtype` (what
    the mixed-precision policy asks for) when given. An error of the forward is recorded, not
    raised: the comparisons already made stay part of the verdict."""
    quantized = impl.is_quantized(param)
    dtype_problem = ""
    if dtype is not None and param.dtype != dtype:
        dtype_problem = f"the unsharded weight is {param.dtype}, the mixed-precision policy asks for {dtype}"
    if golden.q is None:
        return Stage(label, quantized, dtype_problem=dtype_problem,
                     accepted_unholdable=golden.error or "the format cannot hold this shape")
    m, k = flat_dims(golden.q.shape)
    y_ref = torch.matmul(x.to(param.dtype), golden.dequantized_as(param.dtype).transpose(-1, -2))
    if not quantized:
        values = param.detach().float().reshape(golden.q.shape)
        return Stage(label, quantized, digest({"values": values}, {}), dtype_problem=dtype_problem,
                     values=_against_golden(values.reshape(m, k), golden))
    got = impl.read_buffers(param)
    diffs = tuple(compare_buffers(got, golden.q))
    buffers_digest = digest(got, golden.q.valid)
    dequantized, where = None, ()
    if not diffs:
        # The harness's own dequantization reads only the valid regions it just found bit-identical.
        dequantized = Comparison(True, detail=IDENTICAL_BUFFERS)
    elif not any(d.problem.breaks_layout for d in diffs):
        gathered = QuantizedTensor(fmt.name, golden.q.shape, got, golden.q.valid)
        dequantized = compare_value_blocks((fmt.dequantize_rows(gathered, rows.start, rows.stop), want)
                                           for rows, want in golden.dequantized_blocks())
        where = tuple(locate(fmt, gathered, golden.q, shards))
    blocks = fmt.row_blocks(golden.q.shape)
    own = impl.own_dequantize_blocks(param, fmt, blocks)
    own_dequantized = None if own is None else \
        compare_value_blocks(_paired_with_golden(impl, own, golden, len(blocks)))
    output, output_digest, forward_error = _forward_checks(impl, fmt, param, x, y_ref)
    return Stage(label, quantized, buffers_digest, buffer_diffs=diffs, dequantized=dequantized,
                 own_dequantized=own_dequantized, output=output, output_digest=output_digest,
                 forward_error=forward_error, where=where, dtype_problem=dtype_problem)


def _paired_with_golden(impl: Implementation, own: Iterable[torch.Tensor], golden: Golden, n_blocks: int):
    """(own block, golden block) pairs; an implementation that yields another number of blocks than
    it was asked for would have some rows compared twice or not at all: said, with the counts."""
    own = iter(own)
    for count, (_, want) in enumerate(golden.dequantized_blocks()):
        got = next(own, None)
        if got is None:
            raise HarnessFault(f"{impl.name}: own_dequantize_blocks yielded {count} blocks for the {n_blocks} "
                               "row blocks it was asked for")
        yield got, want
    if next(own, None) is not None:
        raise HarnessFault(f"{impl.name}: own_dequantize_blocks yielded more than the {n_blocks} row blocks "
                           "it was asked for")


def _against_golden(values: torch.Tensor, golden: Golden) -> Comparison:
    """`values` (the flattened (M, K) weight) against the golden's, block of rows by block."""
    return compare_value_blocks((values[rows], want) for rows, want in golden.dequantized_blocks())


def _forward_checks(impl: Implementation, fmt: Format, param, x, y_ref) -> tuple[Comparison | None, str, str]:
    """(the layer output against the golden layer's, its digest, the forward's error)."""
    try:
        y = impl.forward(param, x.to(param.dtype))
    except Exception as exc:  # noqa: BLE001 - the forward's error is evidence, next to the comparisons
        return None, "", _one_line(exc)
    return compare_values(y, y_ref, impl.output_tolerance(fmt.name)), digest({"output": y}, {}), ""


@dataclass
class TwinOutput:
    """What the library's module on one device, holding the full weight, computed (`output`), or
    why it computed nothing (`note`)."""

    output: torch.Tensor | None = None
    note: str = ""


def twin_output(impl: Implementation, spec: CaseSpec, weight: torch.Tensor, x: torch.Tensor,
                compute_dtype: torch.dtype) -> TwinOutput | None:
    """The one-device twin's forward of `x` in the dtype the layer computes in (the mixed-precision
    policy's param_dtype: FSDP2 casts a root's inputs to it); None when the library has no module
    of its own. A shape the twin cannot run either is a note, not the gather's fault."""
    x = x.to(device=weight.device, dtype=compute_dtype)
    try:
        expected = impl.single_device_output(spec, weight, x)
    except NoSingleDeviceTwin as exc:
        return TwinOutput(note=str(exc))
    except Exception as exc:  # noqa: BLE001 - the library's own limit, recorded as a note
        return TwinOutput(note=f"the one-device module cannot run this case either: {_one_line(exc)}")
    return None if expected is None else TwinOutput(expected)


def module_check(impl: Implementation, spec: CaseSpec, module: torch.nn.Module, twin: TwinOutput | None,
                 x: torch.Tensor, compute_dtype: torch.dtype) -> ModuleCheck | None:
    """The library's own forward with the gathered weight against its one-device twin's output."""
    if twin is None or twin.output is None:
        return None if twin is None else ModuleCheck(note=twin.note)
    try:
        got = impl.module_output(spec, module, x.to(device=twin.output.device, dtype=compute_dtype))
    except Exception as exc:  # noqa: BLE001 - evidence: the same forward ran on one device
        return ModuleCheck(error=_one_line(exc))
    return ModuleCheck(output=compare_values(got, twin.output))


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


# ------------------------------------------------------------------ FSDP2 scenarios (on the rank pool)
def _local_shard(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    return weight._local_tensor if hasattr(weight, "_local_tensor") else weight


def run_on_rank(ctx, case_id: str, checkpoint: str | None = None) -> RankResult:
    """Entry point on every rank of a pool: one case, end to end (`checkpoint`: the directory a
    `dcp-wsA` case loads, qgather.scenarios.checkpoint). An exception leaving it carries the phase
    it was raised in (qgather.model.phases)."""
    phases = PhaseTracker()
    with phases.tagging():
        return _run_on_rank(ctx, CaseSpec.parse(case_id), phases, checkpoint)


def build_sharded_module(ctx, spec: CaseSpec, phases: PhaseTracker, master: torch.Tensor | None = None,
                         setup: fsdp_setup.Setup | None = None):
    """The implementation's module holding the quantized `master` (default: the case's), sharded by FSDP2
    as the case's configuration says (`setup`, default: fsdp_setup.prepare)."""
    from torch.distributed.fsdp import fully_shard

    impl = get_impl(spec.impl)
    master = make_weight(spec, ctx.device) if master is None else master
    setup = setup or fsdp_setup.prepare(ctx, spec)
    if fsdp_setup.takes_setup(impl):
        module = impl.make_sharded_module(ctx, spec, master, setup)
    else:  # an adapter written before configurations: FSDP2's defaults only (fsdp_setup.skip_reason)
        module = impl.make_sharded_module(ctx, spec, master)
    if module is None:
        weight = master.to(spec.torch_dtype)
        module = impl.make_module(spec.fmt, weight) or QuantizedLinear(impl, impl.make_param(spec.fmt, weight))
        with phases.at(Phase.SHARD):
            fully_shard(module, **setup.kwargs)
    return module


def _run_on_rank(ctx, spec: CaseSpec, phases: PhaseTracker, checkpoint: str | None = None) -> RankResult:
    from qgather.scenarios import checkpoint as checkpoint_reshard
    from qgather.scenarios import compiled as compiled_forward

    impl, fmt = get_impl(spec.impl), FORMATS[spec.fmt]
    if spec.scenario == "model":
        return impl.run_model(ctx, spec, phases)
    if (spec.config.compile or checkpoint) and spec.scenario == "hooks":
        raise HarnessFault(f"{spec.config.token} needs fully_shard; the hooks scenario has none")
    if (spec.config.saved_at_world_size is None) != (checkpoint is None):
        raise HarnessFault("a dcp-wsA case runs with the checkpoint its runner saved (qgather.scenarios.checkpoint)")
    setup = fsdp_setup.prepare(ctx, spec)  # the configuration's fully_shard kwargs, mesh and shard layout
    device = ctx.device
    if spec.scenario in ("steps", "reshard"):
        master = make_weight(spec, device)
        weight = master.to(spec.torch_dtype)
    else:  # nothing steps the masters: a float32 copy would only hold memory
        master = weight = make_weight(spec, device, spec.torch_dtype)
    x = make_input(spec).to(device)
    if spec.scenario == "hooks":
        golden = golden_for(fmt, weight, impl)
        stages, wire_summary = _hooks_on_rank(ctx, impl, fmt, spec, weight, golden, x, setup.shards, phases)
        return RankResult(ctx.rank, tuple(stages), wire_summary, golden.quantizer_diffs or None)
    # The one-device twin first: its full-size module is gone before the golden and the shards exist.
    twin = twin_output(impl, spec, weight, x, setup.param_dtype)
    golden = golden_for(fmt, weight, impl)
    shards = setup.shards
    quantizer = golden.quantizer_diffs or None
    module = build_sharded_module(ctx, spec, phases, checkpoint_reshard.initial_master(spec, master), setup)
    weight_shape = weight.to("meta")  # what the wire summary reads of the weight (shape, dtype)
    if spec.scenario == "gather":
        del master, weight  # the module holds its shard; a large weight's full copy would only hold memory
    loaded = checkpoint_reshard.load(ctx, spec, module, checkpoint, phases)
    if spec.scenario == "steps":
        _requantize_unchanged(ctx, impl, spec, module, master, setup, phases)
    param_types = (type(_local_shard(module)),)
    stages = []
    with phases.at(Phase.SHARD), hooks_moving_phase(phases, param_types):
        with impl.gather_context(ctx.group), record_wire(param_types) as wire:
            module.unshard()
    with phases.at(Phase.INSPECTION):
        first = inspect(impl, fmt, module.weight, golden, x, shards, "unshard 1", setup.param_dtype)
        stages.append(replace(first, module=module_check(impl, spec, module, twin, x, setup.param_dtype), note=loaded))
    module.reshard()
    if spec.config.compile:
        stages.append(compiled_forward.compiled_stage(impl, spec, module, x.to(spec.torch_dtype), ctx.group, phases))
        module.reshard()  # a root's forward leaves its weight unsharded (FSDP2 keeps it for the backward)
    if spec.scenario in ("steps", "reshard"):
        stages.extend(_update_and_regather(ctx, impl, fmt, spec, module, master, x, setup, phases))
    return RankResult(ctx.rank, tuple(stages), summarize_wire(wire, fmt, weight_shape, shards, golden, impl), quantizer)


def _requantize_unchanged(ctx, impl, spec, module, master, setup, phases: PhaseTracker) -> None:
    """An optimizer step may come before the first gather (e.g. TE's `quantize_` into the sharded
    parameter): re-quantizing each shard from its own, unchanged master rows must leave the gathered
    weight as it was, the amax reduced over the shard group although no pre-hook has run yet."""
    with torch.no_grad(), phases.at(Phase.STEP):
        impl.requantize_shard(_local_shard(module), setup.master_slice(master).to(spec.torch_dtype), ctx.group)
        impl.after_step(module, ctx.group)


def _update_and_regather(ctx, impl, fmt, spec, module, master, x, setup, phases: PhaseTracker) -> list[Stage]:
    """Optimizer steps on the sharded master rows, re-quantized on the shards, then the `out=`
    path of the next unshard; the golden takes the same steps on the full weight."""
    n_steps = STEPS if spec.scenario == "steps" else 1
    full = master.clone()
    shards = setup.shards
    shard_master = torch.nn.Parameter(setup.master_slice(master).clone())
    full_param = torch.nn.Parameter(full)
    opt_shard = torch.optim.SGD([shard_master], lr=LEARNING_RATE, momentum=0.9)
    opt_full = torch.optim.SGD([full_param], lr=LEARNING_RATE, momentum=0.9)
    stages = []
    for step in range(1, n_steps + 1):
        grad = make_gradient(spec, step, master.device)
        shard_master.grad, full_param.grad = setup.master_slice(grad).clone(), grad.clone()
        opt_shard.step()
        opt_full.step()
        with torch.no_grad(), phases.at(Phase.STEP):
            impl.requantize_shard(_local_shard(module), shard_master.detach().to(spec.torch_dtype), ctx.group)
            impl.after_step(module, ctx.group)
            golden = golden_for(fmt, full_param.detach().to(spec.torch_dtype), impl)
        param_types = (type(_local_shard(module)),)
        label = f"unshard {step + 1} (after step {step})"
        if setup.forward_gathers:
            def judge(weight, what, label=label, golden=golden):
                with phases.at(Phase.INSPECTION):
                    return inspect(impl, fmt, weight, golden, x, shards, f"{label}, {what}", setup.param_dtype)

            with phases.at(Phase.STEP), hooks_moving_phase(phases, param_types), impl.gather_context(ctx.group):
                stages.extend(fsdp_setup.gather_through_forward(module, x.to(setup.param_dtype), judge))
            continue
        with phases.at(Phase.STEP), hooks_moving_phase(phases, param_types), impl.gather_context(ctx.group):
            module.unshard()
        with phases.at(Phase.INSPECTION):
            stage = inspect(impl, fmt, module.weight, golden, x, shards, label, setup.param_dtype)
            twin = twin_output(impl, spec, full_param.detach().to(spec.torch_dtype), x, setup.param_dtype)
            stages.append(replace(stage, module=module_check(impl, spec, module, twin, x, setup.param_dtype)))
        module.reshard()
    return stages


# ------------------------------------------------------------------ hooks and virtual scenarios
class VirtualMesh:
    """What the hooks read from a mesh: its size. Used where no real DeviceMesh exists."""

    def __init__(self, world_size: int) -> None:
        self._size = world_size

    def size(self, dim: int | None = None) -> int:
        return self._size


def fsdp2_chunks(param: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """FSDP2's dim-0 split of a parameter: torch.chunk, padded with new_empty(0) placeholders."""
    chunks = list(torch.chunk(param, world_size, dim=0))
    while len(chunks) < world_size:
        chunks.append(chunks[0].new_empty(0))
    return chunks


def shard_like_fsdp2(param: torch.Tensor, piece: torch.Tensor, shards: ShardLayout) -> torch.Tensor:
    """A rank's local shard, built through the same subclass ops FSDP2's FSDPParam uses on its
    chunk: new_zeros to the padded size, narrow + copy_, narrow."""
    padded = param.new_zeros((shards.chunk, *param.shape[1:]))
    length = piece.size(0) if piece.numel() > 0 else 0
    if length:
        padded.narrow(0, 0, length).copy_(piece)
    return padded.narrow(0, 0, length)


class PaddedSizeRule(HarnessFault):
    """FSDP2's rule for uneven shards, checked by the harness where it calls the hooks itself. It is
    raised only on ranks with padding, as FSDP2 raises it; never an implementation's rejection."""


class WouldDeadlock(HarnessFault):
    """Virtual ranks that would hand the collective different sizes."""


def check_padded_inputs(local: torch.Tensor, inputs, shards: ShardLayout, full_shape) -> None:
    """FSDP2's own rule for uneven shards, applied where the harness calls the hooks itself."""
    padded = torch.Size((shards.chunk, *full_shape[1:]))
    if local.size() != padded and any(t.size() != padded for t in inputs):
        raise PaddedSizeRule(
            f"When a parameter is unevenly sharded by FSDP (orig size={tuple(full_shape)}, FSDP world size="
            f"{shards.world_size}), fsdp_pre_all_gather must return all-gather inputs with the padded "
            f"sharded size {tuple(padded)} but got {[tuple(t.size()) for t in inputs]}"
        )


def _pre_all_gather(local, mesh, full_shape):
    """Call the pre-hook as FSDP2 does: the one-argument (mesh) form is still accepted there."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if len(signature(local.fsdp_pre_all_gather).parameters) == 1:
        return local.fsdp_pre_all_gather(mesh)
    stride = torch.empty(0).new_empty(full_shape).stride()
    return local.fsdp_pre_all_gather(mesh, torch.Size(full_shape), stride, None, MixedPrecisionPolicy())


def _hooks_on_rank(ctx, impl, fmt, spec, weight, golden, x, shards, phases: PhaseTracker):
    """The hooks around a direct all-gather of each input's bytes, without fully_shard."""
    param = impl.make_param(spec.fmt, weight)
    with phases.at(Phase.SHARD):
        local = shard_like_fsdp2(param, fsdp2_chunks(param, ctx.world_size)[ctx.rank], shards)
    with record_wire((type(local),)) as wire:
        with phases.at(Phase.PRE_HOOK):
            inputs, metadata = _pre_all_gather(local, ctx.mesh, weight.shape)
            check_padded_inputs(local, inputs, shards, weight.shape)
        with phases.at(Phase.COLLECTIVE):
            outputs = [_all_gather_bytes(t, ctx.world_size, ctx.group) for t in inputs]
    with phases.at(Phase.POST_HOOK):
        unsharded, _ = local.fsdp_post_all_gather(tuple(outputs), metadata, weight.dtype)
    with phases.at(Phase.INSPECTION):
        stage = inspect(impl, fmt, unsharded, golden, x, shards, "hooks")
    return [stage], summarize_wire(wire, fmt, weight, shards, golden, impl)


def _all_gather_bytes(t: torch.Tensor, world_size: int, group) -> torch.Tensor:
    # gloo rejects float8 dtypes: move bytes, then view them back as the input's dtype.
    src = t.contiguous().view(torch.uint8).reshape(-1)
    out = src.new_empty(src.numel() * world_size)
    dist.all_gather_into_tensor(out, src, group=group)
    return out.view(t.dtype).reshape(t.shape[0] * world_size, *t.shape[1:])


def run_virtual(spec: CaseSpec) -> list[RankResult | BaseException]:
    """One process emulates every rank of the world: FSDP2's chunking, each rank's own shard and
    pre-hook (a rank may raise while the others would enter the collective), concatenation in rank
    order, and the post-hook of every rank whose metadata differs. Returns one result (or the
    exception it raised, tagged with its phase) per virtual rank; an exception raised before the
    ranks split propagates."""
    impl, fmt = get_impl(spec.impl), FORMATS[spec.fmt]
    weight = make_weight(spec).to(spec.torch_dtype)
    golden = golden_for(fmt, weight, impl)
    shards = shard_layout(spec)
    phases = PhaseTracker()
    with phases.tagging():
        param = impl.make_param(spec.fmt, weight)
        with phases.at(Phase.SHARD):
            pieces = fsdp2_chunks(param, spec.world_size)
    locals_ = [_on_virtual_rank(Phase.SHARD, shard_like_fsdp2, param, piece, shards) for piece in pieces]
    mesh = VirtualMesh(spec.world_size)
    param_type = next((type(t) for t in locals_ if not isinstance(t, BaseException)), type(param))
    with record_wire((param_type,)) as wire:
        pre = [t if isinstance(t, BaseException) else
               _on_virtual_rank(Phase.PRE_HOOK, _checked_pre_all_gather, t, mesh, weight.shape, shards)
               for t in locals_]
    if any(isinstance(p, BaseException) for p in pre):
        return pre  # the other ranks would wait in the all-gather
    shapes = [tuple((t.dtype, tuple(t.shape)) for t in inputs) for inputs, _ in pre]
    if len(set(shapes)) > 1:
        deadlock = WouldDeadlock("would deadlock: the virtual ranks hand the all-gather different sizes: "
                                 + "; ".join(f"rank {r} {s}" for r, s in enumerate(shapes)))
        deadlock.qgather_phase = Phase.COLLECTIVE.value
        return [deadlock] * spec.world_size
    outputs = tuple(torch.cat([inputs[i] for inputs, _ in pre]) for i in range(len(pre[0][0])))
    wire_summary = replace(summarize_wire(wire, fmt, weight, shards, golden, impl),
                           collective_bytes=sum(t.numel() * t.element_size() for t in pre[0][0]),
                           hook_calls=int(pre[0][1] is not PLAIN),
                           collectives=int(spec.world_size > 1))  # the emulated one
    x = make_input(spec)
    results: list[RankResult | BaseException] = []
    seen: dict[str, Stage | BaseException] = {}
    for rank, (local, (_, metadata)) in enumerate(zip(locals_, pre)):
        key = repr(_metadata_key(metadata))
        if key not in seen:
            seen[key] = _on_virtual_rank(Phase.POST_HOOK, _post_and_inspect, impl, fmt, local, outputs, metadata,
                                         weight.dtype, golden, x, shards)
        stage = seen[key]
        results.append(stage if isinstance(stage, BaseException) else
                       RankResult(rank, (stage,), wire_summary, golden.quantizer_diffs or None))
    return results


def _on_virtual_rank(phase: Phase, fn, *args):
    """One virtual rank's step: its result, or the exception it raised (tagged with the phase)."""
    phases = PhaseTracker()
    try:
        with phases.at(phase), phases.tagging():
            return fn(*args)
    except Exception as exc:  # noqa: BLE001 - each virtual rank's own error is its result
        return exc


PLAIN = "plain tensor: no hooks"  # the metadata of a shard FSDP2 gathers as it is


def _checked_pre_all_gather(local, mesh, full_shape, shards):
    if not hasattr(local, "fsdp_pre_all_gather"):
        # A shard that fell back to a plain tensor: FSDP2 gathers its padded values, no hooks run.
        padded = local.new_zeros((shards.chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        return (padded,), PLAIN
    inputs, metadata = _pre_all_gather(local, mesh, full_shape)
    check_padded_inputs(local, inputs, shards, full_shape)
    return inputs, metadata


def _post_and_inspect(impl, fmt, local, outputs, metadata, dtype, golden, x, shards) -> Stage:
    if metadata is PLAIN:
        unsharded = outputs[0][: shards.dim0]
    else:
        unsharded, _ = local.fsdp_post_all_gather(outputs, metadata, dtype)
    return inspect(impl, fmt, unsharded, golden, x, shards, "virtual gather")


def _metadata_key(metadata) -> object:
    """Hashable content of a hook's metadata, to post-process each distinct metadata once."""
    if isinstance(metadata, torch.Tensor):
        return ("tensor", tuple(metadata.shape), metadata.detach().cpu().flatten().tolist()[:64],
                float(metadata.detach().double().sum()) if metadata.numel() else 0.0)
    if isinstance(metadata, dict):
        return tuple((k, _metadata_key(v)) for k, v in sorted(metadata.items(), key=lambda kv: str(kv[0])))
    if isinstance(metadata, (list, tuple)):
        return tuple(_metadata_key(v) for v in metadata)
    if hasattr(metadata, "__dict__"):
        return (type(metadata).__name__, _metadata_key(vars(metadata)))
    return repr(metadata)
