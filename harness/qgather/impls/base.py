"""The adapter protocol between qgather and an implementation under test: `Implementation`.

An implementation is a tensor subclass (or a library) that FSDP2 all-gathers through
`fsdp_pre_all_gather` / `fsdp_post_all_gather`. The harness needs only a handful of things from
it, listed on `Implementation` (an abstract base: an adapter missing a required method is refused
when it is loaded, `missing_methods`); everything else (sharding, gathering, comparing against the
golden reference) is the harness's job.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from qgather.errors import HarnessFault
from qgather.impls.rejections import DeclaredRejections, RejectionType
from qgather.model.case import SCENARIOS, CaseSpec

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["PACKED_SLACK", "SCENARIO_METHODS", "HarnessFault", "Implementation", "NoSingleDeviceTwin",
           "missing_methods"]

PACKED_SLACK = 1.1

#: the methods a scenario calls beyond those every adapter provides: an adapter that lists the
#: scenario in `scenarios` must override them (checked at load, `missing_methods`)
SCENARIO_METHODS: dict[str, tuple[str, ...]] = {
    "steps": ("requantize_shard",),
    "reshard": ("requantize_shard",),
    "hooks": ("make_param",),  # the hooks and virtual scenarios shard the parameter themselves
    "virtual": ("make_param",),
    "model": ("run_model",),
    "layers": ("requantize_shard",),  # the layers scenario takes optimizer steps too
    "block": ("requantize_shard",),  # and so does the block scenario
}
#: the two routes to a sharded module: the harness's own FSDP2 route, or the library's own
ROUTES = ("make_param", "make_sharded_module")
#: the routes to a layer of the block scenario's one fully_shard group (any one of them)
BLOCK_ROUTES = ("make_param", "make_module", "make_block_layer")


class NoSingleDeviceTwin(HarnessFault):
    """`single_device_output` cannot build a one-device module that holds the same quantized weight
    as the sharded one (its message says why); the library's forward is then not compared."""


class Implementation(abc.ABC):
    """Base class for adapters. Subclasses set the class attributes and override the methods:
    `read_buffers` and `is_quantized` always (abstract), one of `make_param` / `make_sharded_module`,
    and the methods their scenarios call (SCENARIO_METHODS); the registry refuses an adapter that
    lacks one, naming it (`missing_methods`).

    The harness calls, on every rank:
      1. `skip_reason(spec, device)`: None to run, else a one-line reason to skip the case.
      2. either `make_sharded_module(ctx, spec, master, setup)`: the module already sharded the way the
         library's users shard it (e.g. TE: built on meta, `fully_shard`, `reset_parameters`), or,
         when that returns None, `make_param(fmt, weight)`: the quantized parameter of the FULL
         weight (every rank builds the same one from the same seed), which the harness wraps in a
         linear layer and shards with `fully_shard` through the subclass's ops.
      3. after an unshard, `read_buffers(param)`: the gathered buffers under the format's
         TransformerEngine names (see qgather.formats), compared bit for bit with the golden.
      4. for the `steps` / `reshard` / `layers` scenarios, `requantize_shard(local, master_rows, group)`:
         re-quantize the rank's shard from its updated high-precision master rows in place,
         as an optimizer step would.
    The `layers` scenario builds a module of several weights through the same methods (2, one
    call per weight), and calls `skip_reason` per weight too: a weight it skips is left out.
    """

    name: str = ""
    formats: tuple[str, ...] = ()
    #: every scenario but `model`, which only a library with layers of its own runs (te)
    scenarios: tuple[str, ...] = tuple(s for s in SCENARIOS if s != "model")
    devices: tuple[str, ...] = ("cpu", "cuda")
    #: backends whose all-gather this implementation can use as it is
    backends: tuple[str, ...] = ("gloo", "nccl")
    #: exception types with which it refuses a shape it cannot gather: classes, class names, or
    #: "ClassName: message prefix" where a broad type (AssertionError) is a refusal only with that
    #: message. Raised on every rank before any data moved, they make a case REJECTED; any other
    #: error is an ERROR. Undeclared (the default): no error is ever a rejection.
    #: A class matches by its qualified name (module.qualname), so a class of the same name from
    #: another module never does; a string matches by bare class name (qgather.impls.rejections).
    rejection_types: tuple[RejectionType, ...] = ()
    #: True: `make_sharded_module` builds the module and reads no more of `master` than this rank's
    #: part, `setup.master_slice(master)` (TE's route writes just those rows). A gather case whose golden
    #: and twin are kept may then draw only those rows, the others NaN (qgather.scenarios.fsdp.rows_to_draw).
    #: False (the default): the full master is read, as the harness's route does (make_param quantizes
    #: the FULL weight: a tensor-wise amax, say, reads every row).
    reads_own_rows_only: bool = False
    #: modules a rank imports on its first case of this implementation (a library's, imported on use):
    #: a run's forkserver on a CPU build of torch imports them once for every rank it forks
    #: (qgather.runtime.helpers.preload_for_run)
    rank_imports: tuple[str, ...] = ()

    def refusal_problem(self, error: object) -> str:
        """Whether `error` is one of this implementation's declared refusals (`rejection_types`).

        Args:
            error: what a rank raised: a qgather.runtime.outcome.RankError (matched through its
                `type_qualnames`, `type_names` and `message`) or the exception itself.
        Returns:
            "" when it is a declared refusal, else one line saying it is not, naming the declared types.
        """
        return DeclaredRejections.of(self.rejection_types, self.name or type(self).__name__).problem(error)

    def skip_reason(self, spec: CaseSpec, device: torch.device) -> str | None:
        """Why this implementation cannot run the case on `device` (SKIPPED, with the reason), or None.
        Override it to leave out cases the library does not support at all (a shape, a dtype), and
        return `super().skip_reason(spec, device)` otherwise; a case it refuses on purpose is no skip but
        a `rejection_types` error, which the policy judges.

        Example:
            def skip_reason(self, spec, device):
                if len(spec.shape) > 2:
                    return "mylib holds 2-D weights only"
                return super().skip_reason(spec, device)
        """
        if spec.fmt not in self.formats:
            return f"{self.name} does not implement format {spec.fmt}"
        if spec.scenario not in self.scenarios:
            return f"{self.name} does not support scenario {spec.scenario}"
        if device.type not in self.devices:
            return f"{self.name} does not run on {device.type}"
        if spec.scenario == "block" and not any(_overrides(type(self), m) for m in BLOCK_ROUTES):
            return (f"{self.name} builds its sharded modules itself (make_sharded_module); the block scenario "
                    f"builds one fully_shard group of several weights through one of {', '.join(BLOCK_ROUTES)}")
        return None

    def make_param(self, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        """The quantized parameter of the FULL weight (every rank builds the same one from the same
        seed), which the harness wraps in a linear layer and shards with `fully_shard`. Required
        unless the adapter builds its sharded module itself (`make_sharded_module`), and for the
        hooks and virtual scenarios."""
        raise HarnessFault(f"{self.name} has no make_param")

    def make_sharded_module(self, ctx, spec: CaseSpec, master: torch.Tensor,
                            setup=None) -> torch.nn.Module | None:
        """A module holding this rank's shard of the case's weight as `.weight`, already passed
        through `fully_shard` and initialized the library's way. For libraries with deferred or
        sharded initialization. `ctx` has rank, world_size, device, group and mesh; `master` is the
        full master weight (cast it to spec.torch_dtype). `setup` (qgather.scenarios.fsdp_setup.Setup) is the
        case's FSDP2 configuration: `fully_shard(module, **setup.kwargs)` (mesh, mp_policy,
        reshard_after_forward, shard_placement_fn) and this rank's part of the master,
        `setup.master_slice(master)`. An adapter whose method takes no `setup` parameter runs
        FSDP2's default configuration only (its configured cases are SKIPPED, saying so).
        None (the default): the harness builds and shards the module (make_module / make_param)."""
        return None

    def make_block_layer(self, ctx, spec: CaseSpec, master: torch.Tensor, setup) -> torch.nn.Module | None:
        """For the block scenario: a layer holding the weight `spec` describes (`.weight`), built the
        library's way but not sharded (e.g. TE's te.Linear on meta under quantized_model_init, whose
        init writes this rank's rows, `setup.master_slice(master)`): the scenario shards it in one
        `fully_shard` group with the block's other parameters, then calls `materialize_block_layer`.
        None (the default): the harness builds it (make_module / make_param)."""
        return None

    def materialize_block_layer(self, module: torch.nn.Module) -> None:
        """Called on every rank, once the block is sharded, for each layer `make_block_layer` built (e.g.
        TE's reset_parameters: materialize and quantize this rank's shard). Nothing by default."""
        return None

    def tensor_parallel_style(self, rowwise: bool) -> ParallelStyle:
        """The style that distributes the module's weight on the "tp" mesh dimension in tp-DxT cases
        (before fully_shard on "dp"): torch's ColwiseParallel (Shard(0)) or, for `tp-DxT-row`,
        RowwiseParallel (Shard(1)). A library with tensor-parallel styles of its own returns those
        (torchao's Float8ColwiseParallel / Float8RowwiseParallel)."""
        # deferred: torch.distributed.tensor costs ~0.6 s to import, and listing cases needs no rank
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return RowwiseParallel() if rowwise else ColwiseParallel()

    def make_module(self, fmt: str, weight: torch.Tensor) -> torch.nn.Module | None:
        """A module holding the quantized weight as `.weight`, for libraries whose quantized
        parameter only exists inside their own module type (e.g. torchao's Float8Linear).
        None (the default): the harness wraps `make_param(fmt, weight)` in a bias-free linear layer."""
        return None

    @abc.abstractmethod
    def read_buffers(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The gathered weight's buffers under the format's TransformerEngine names
        (qgather.formats), compared bit for bit with the golden."""

    def requantize_shard(
        self, local: torch.Tensor, master_rows: torch.Tensor, group: torch.distributed.ProcessGroup | None
    ) -> None:
        """Re-quantize this rank's shard `local` in place from its updated high-precision master rows,
        as an optimizer step would (the amax reduced over `group` where the format scales per
        tensor). `group` holds every rank with a piece of the weight: the case's world (under
        tensor parallelism both mesh dimensions, not only FSDP2's "dp" mesh). Required for the
        steps and reshard scenarios."""
        raise HarnessFault(f"{self.name} has no requantize_shard")

    def config_skip_reason(self, spec: CaseSpec) -> str | None:
        """Why this implementation cannot run the case's FSDP2 configuration (SKIPPED), or None.
        Called only for configured cases (qgather.model.config) that torch itself can run."""
        return None

    def forward_context(self, spec: CaseSpec) -> contextlib.AbstractContextManager:
        """What the library's own module forward runs under (e.g. TE's te.autocast with the
        case's recipe); used where the harness calls the module itself (torch.compile)."""
        return contextlib.nullcontext()

    def after_step(self, module: torch.nn.Module, group) -> None:
        """Called on every rank after all shards were re-quantized for a step (e.g. to precompute
        scales for the next all-gather, as torchao's precompute_float8_dynamic_scale_for_fsdp does).
        Nothing by default."""
        return None

    def reference_quantize(self, fmt, weight: torch.Tensor):
        """The reference format's quantization this implementation's recipe asks for (a
        qgather.formats.QuantizedTensor): by default the format's own semantics (current scaling,
        global amax). A recipe with other semantics names them here, e.g. delayed scaling's
        initial scale of 1 (`fmt.quantize(weight, amax=...)`)."""
        return fmt.quantize(weight)

    def own_quantization(self, fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The implementation's own single-device quantization of the full weight, if it has its
        own quantizer; None when it uses the harness's reference formats (nothing to cross-check)."""
        return None

    def own_quantization_parts(self, fmt: str, weight: torch.Tensor) -> Iterator[dict[str, torch.Tensor]] | None:
        """`own_quantization` in parts (e.g. one per usage: rowwise, then columnwise), each a dict of
        some of its buffers, so that the golden's cross-check holds one part at a time next to the
        reference. The default: the whole of own_quantization as one part."""
        own = self.own_quantization(fmt, weight)
        return None if own is None else iter((own,))

    def wire_allowance(self, fmt: str, shape: tuple[int, ...], shards, packed_bytes: int) -> tuple[str, int]:
        """How many bytes per rank its all-gather may move for a shard whose packed buffers take
        `packed_bytes` (qgather.check.wire.packed_shard_bytes), and the name of that wire mode. More
        than that is DEGRADED: the gather moved something bigger than the quantized shard (e.g.
        high-precision values, whatever dtype label they carry). Default: the packed size plus 10%
        for per-buffer alignment."""
        return "packed", math.ceil(packed_bytes * PACKED_SLACK)

    def own_dequantize(self, param: torch.Tensor) -> torch.Tensor | None:
        """The implementation's own dequantization of a gathered weight (compared with the golden's
        dequantized values on every rank), or None when it has none of its own."""
        return None

    def own_dequantize_blocks(self, param: torch.Tensor, fmt,
                              blocks: list[tuple[int, int]]) -> Iterator[torch.Tensor] | None:
        """`own_dequantize` of the rows [start, stop) of each block of the flattened (M, K) weight, in
        order (qgather.formats.Format.check_blocks), or None when it has none. The default cuts one
        whole dequantization; an adapter whose tensors can be cut by rows overrides it, so that a
        large gathered weight is never held dequantized whole."""
        own = self.own_dequantize(param)
        if own is None:
            return None
        rows = own.reshape(blocks[-1][1], -1)
        return (rows[start:stop] for start, stop in blocks)

    def forward(self, param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output with this (unsharded) weight: y = x @ W^T (batched over experts)."""
        return torch.matmul(x, param.transpose(-1, -2))

    def forward_rows(self, param: torch.Tensor, x: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
        """The output columns [start, stop) of `forward` for a 2-D weight (x @ W[start:stop]^T),
        computed the way `forward` computes them, or None (the default) when the weight cannot be cut
        by rows. With it, a large weight's output is checked block by block on both sides (the golden
        layer with the same blocks, so the comparison stays bit for bit) and never held in the layer's
        dtype whole."""
        return None

    def forward_own_rows(self, x: torch.Tensor, own_rows: torch.Tensor) -> torch.Tensor | None:
        """`forward_rows`'s output columns from rows that `own_dequantize_blocks` just made (float32),
        for an adapter whose forward multiplies its own dequantization (TE: its float32 rows rounded to
        the layer's dtype): the inspection then dequantizes each row block once, for the value check
        and the layer output alike. None (the default): `forward_rows` computes them."""
        return None

    def run_model(self, ctx, spec: CaseSpec, phases) -> object:
        """The `model` scenario: the library's own small model trained sharded against the same
        model on one device (a qgather.model.records.RankResult). Only libraries with layers of their own."""
        raise HarnessFault(f"{self.name} has no model scenario")

    def module_output(self, spec: CaseSpec, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The library's own forward of the sharded module, called right after an unshard (e.g.
        te.Linear under te.autocast), or None when the library has no layer of its own to run.
        Compared bit for bit with `single_device_output`."""
        return None

    def single_device_output(self, spec: CaseSpec, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """The same module and recipe on this rank's device alone, holding the full `weight`
        (spec.torch_dtype): its forward on `x`, in x's dtype or widened to float32 (the block scenario
        rounds it to x's dtype, as the sharded layer returns it). `x` is on the rank's device;
        `weight` too, except a large one (qgather.check.host.PARK_BYTES), which waits in pinned host
        memory while the module holds its own copy: copy from it into the module rather than moving
        it whole."""
        return None

    def gather_context(self, group) -> contextlib.AbstractContextManager:
        """Entered around every unshard; e.g. a transport shim for a backend (qgather.impls.torchao.transport)."""
        return contextlib.nullcontext()

    def output_tolerance(self, fmt: str) -> float | None:
        """None: `forward` runs the same math as the golden layer and must match bit for bit.
        Otherwise the relative bound (times max|golden output|) for an output computed by another
        kernel (e.g. an FP8 GEMM); it is printed with every verdict that used it."""
        return None

    @abc.abstractmethod
    def is_quantized(self, param: torch.Tensor) -> bool:
        """Whether `param` still is the implementation's quantized type (not a high-precision fallback)."""


def _overrides(adapter: type[Implementation], method: str) -> bool:
    return getattr(adapter, method, None) is not getattr(Implementation, method)


def missing_methods(adapter: type[Implementation] | Implementation) -> list[str]:
    """What an adapter (class or instance) lacks to run the scenarios it lists, one entry per
    method (empty: complete): the abstract methods it leaves abstract, a route to a sharded module
    (`make_param` or `make_sharded_module`), and the methods of SCENARIO_METHODS its `scenarios` need.

    Example:
        >>> class Half(Implementation):
        ...     def is_quantized(self, param): return True
        >>> missing_methods(Half)
        ['read_buffers', 'make_param or make_sharded_module', 'requantize_shard (for steps, reshard, layers, block)', \
'make_param (for hooks, virtual)']
    """
    cls = adapter if isinstance(adapter, type) else type(adapter)
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if not any(_overrides(cls, route) for route in ROUTES):
        missing.append(" or ".join(ROUTES))
    needs: dict[str, list[str]] = {}
    for scenario in adapter.scenarios:
        for method in SCENARIO_METHODS.get(scenario, ()):
            needs.setdefault(method, []).append(scenario)
    for method, scenarios in needs.items():
        if not _overrides(cls, method):
            missing.append(f"{method} (for {', '.join(scenarios)})")
    return missing
