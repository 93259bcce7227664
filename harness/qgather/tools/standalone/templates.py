"""Which template a case's script is made of (`template_for`) and the constants its pieces are
specialized with (`case_constants`): one template per library route, its FSDP2 configuration
decided by the case's constants: torchao's float8 all-gather (fp8_tensor, torchao and
torchao:precompute), TransformerEngine's FSDP2 route (te: fp8_tensor with Float8CurrentScaling,
fp8_block with Float8BlockScaling; te:delayed: DelayedScaling) and qgather's reference subclass (every
built-in format; carried as source), each over the gather, steps, reshard, layers and block scenarios
and every configuration token (mp-*, raf-*, hsdp-RxS, tp-DxT[-row], dim1, compile, dcp-wsA[-trained],
nested). Any other case id is refused in one line saying why (`UnsupportedCase`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from qgather.errors import UsageError
from qgather.model.block import block_params
from qgather.model.case import CaseSpec
from qgather.model.layers import layer_weights
from qgather.tools.standalone import bundle
from qgather.tools.standalone.pieces import fp8_block, fp8_tensor, reference, routes

__all__ = ["Template", "UnsupportedCase", "case_constants", "template_for"]

_DTYPES = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
_TE_RECIPES = {("te", "fp8_tensor"): "Float8CurrentScaling", ("te", "fp8_block"): "Float8BlockScaling",
               ("te:delayed", "fp8_tensor"): "DelayedScaling"}
_STEPS = {"gather": 0, "steps": 3, "reshard": 1}  # optimizer steps, as qgather.scenarios.fsdp takes them
_MODULES = ("layers", "block")  # a module of several weights (qgather.model.layers, qgather.model.block)
#: why a case has no standalone script, by what it is (one line each; `qgather case ID` runs every case)
_WHY_NOT = {
    "mutant": "a zoo mutant is qgather's own reference code with a planted bug, not a library with "
              "maintainers to report to (its script would carry qgather's package as source)",
    "te:prequantized": "te:prequantized's verdict is about the bytes on the wire (DEGRADED), which a script's "
                       "comparison of the gathered buffers does not measure",
    "hooks": "the hooks scenario emulates FSDP2 around the subclass's hooks with qgather's own code, without "
             "fully_shard: its script would be qgather's emulation",
    "virtual": "the virtual scenario runs FSDP2's hooks in one process on qgather's virtual ranks",
    "model": "the model scenario trains the library's model against its one-GPU twin through qgather's "
             "optimizer and inspection",
}


class UnsupportedCase(UsageError):
    """A case id no standalone template covers (the message says why, in one line)."""


@dataclass(frozen=True)
class Template:
    """What a script is made of: the library, its route's functions (name in the script -> piece), the
    golden, the case's constants and, for the reference, the sources it carries."""

    library: str  # the import name the script needs besides torch ("": none)
    functions: tuple[tuple[str, object], ...]  # (name in the script, a function of pieces), in order
    golden: ModuleType  # pieces.fp8_tensor, pieces.fp8_block or pieces.reference
    constants: tuple[tuple[str, str, str, object], ...]  # (name, value source, comment, value) of the route's
    needs_cuda: bool
    sources: dict[str, str] | None = None  # reference: qgather's modules the script carries (bundle)


def template_for(spec: CaseSpec, param_class: type | None = None) -> Template:
    """The template of `spec`, or UnsupportedCase saying in one line why there is none. `param_class`:
    the reference's parameter class in its place (a test hands in a deliberately broken one, a zoo
    mutant's, to see the reference's scripts fail as `qgather case` of that mutant does)."""
    if param_class is not None and spec.impl != "reference":
        raise ValueError(f"{spec.id}: a parameter class replaces the reference's only")
    why = _why_not(spec)
    if why:
        raise UnsupportedCase(f"{spec.id}: no standalone script: {why}; run `qgather case {spec.id}`")
    if spec.impl.startswith("torchao"):
        route = (("layer", routes.layer_torchao), ("read", routes.read_torchao),
                 ("requantize", routes.requantize_torchao), ("forward", routes.forward_module))
        return Template("torchao", route, fp8_tensor, (), needs_cuda=False)
    if spec.impl.startswith("te"):
        route = (("layer", routes.layer_te), ("read", routes.read_te), ("requantize", routes.requantize_te),
                 ("forward", routes.forward_te))
        recipe = _TE_RECIPES[spec.impl, spec.fmt]
        return Template("transformer_engine", route, fp8_block if spec.fmt == "fp8_block" else fp8_tensor,
                        (("RECIPE", repr(recipe), "transformer_engine.common.recipe", recipe),), needs_cuda=True)
    param_class = param_class or _param_class(spec)
    route = (("install", reference.install), ("ReferenceLinear", reference.ReferenceLinear),
             ("layer", reference.layer_reference), ("read", reference.read_reference),
             ("requantize", reference.requantize_reference), ("forward", routes.forward_module))
    return Template("", route, reference, (
        ("FORMAT", repr(spec.fmt), "qgather's format name", spec.fmt),
        ("PARAM_CLASS", repr(bundle.class_path(param_class)), "the tensor subclass under test, in SOURCES", None)),
        needs_cuda=False, sources=bundle.sources(param_class))


def _why_not(spec: CaseSpec) -> str:
    """Why `spec` has no script ("" when it has one)."""
    family = "mutant" if spec.impl.startswith("mutant:") else spec.impl
    if family in _WHY_NOT:
        return _WHY_NOT[family]
    if spec.scenario in _WHY_NOT:
        return _WHY_NOT[spec.scenario]
    if spec.impl not in ("reference", "te", "te:delayed", "torchao", "torchao:precompute"):
        return (f"{spec.impl} is not one of the libraries the scripts know (te, te:delayed, torchao) nor the "
                "reference")
    if spec.impl.startswith("te") and (spec.impl, spec.fmt) not in _TE_RECIPES:
        return (f"{spec.impl}:{spec.fmt} has no inlined golden (the scripts carry FP8 per-tensor and blockwise), "
                "and TE's MXFP8 and NVFP4 kernels need sm_100")
    if spec.impl.startswith("torchao") and spec.fmt != "fp8_tensor":
        return f"torchao's float8 training has no {spec.fmt}"
    if not spec.impl == "reference" and (len(spec.shape) != 2 or (spec.impl == "te" and spec.scenario == "layers")):
        return f"{spec.impl} does not run this case (qgather SKIPs it: 3-D weights, or te's layers scenario)"
    return ""


def case_constants(spec: CaseSpec) -> tuple[tuple[str, str, str, object], ...]:
    """(name, source, comment, value) of every constant a script's pieces may read; a script holds those
    its code reads after its case's `if`s are decided (`value` decides them; None: not a literal)."""
    config = spec.config
    size = spec.world_size
    saved = config.saved_at_world_size or 0
    mp = config.param_dtype and _DTYPES[config.param_dtype]
    reduce = config.reduce_dtype and _DTYPES[config.reduce_dtype]
    rows = [("CASE", repr(spec.id), "", None),
            ("SHAPE", repr(tuple(spec.shape)), "the weight (out_features, in_features)", None),
            ("SEED", str(spec.seed), "the weight is drawn from it exactly as qgather draws it", None),
            ("DTYPE", _DTYPES[spec.dtype], "", None),
            ("WORLD_SIZE", str(max(size, saved)), "ranks launched" if saved else "", None),
            ("WEIGHTS", _weights(spec), "name: (shape, data seed, magnitude)", None),
            ("TP", str(config.tp[1] if config.tp else 0), 'tensor-parallel size: a ("dp", "tp") mesh of '
             "(ranks // TP, TP)", config.tp[1] if config.tp else 0),
            ("TP_DIM", str(int(config.tp_style == "row")), "0: ColwiseParallel (rows), 1: RowwiseParallel (columns)",
             int(config.tp_style == "row")),
            ("HSDP", str(config.hsdp[0] if config.hsdp else 0), 'HSDP replicas: a ("replicate", "shard") mesh',
             config.hsdp[0] if config.hsdp else 0),
            ("SHARD_DIM", str(config.shard_dim), "FSDP2 shards the weight's rows (0) or columns (1)",
             config.shard_dim),
            ("MP", str(mp), "MixedPrecisionPolicy(param_dtype=MP, reduce_dtype=REDUCE)", bool(mp)),
            ("REDUCE", str(reduce), "", None),
            ("RAF", repr(config.reshard_after_forward), "fully_shard's reshard_after_forward",
             config.reshard_after_forward),
            ("COMPILE", str(config.compile), "", config.compile),
            ("SAVED_AT", str(saved), "the checkpoint is saved at SAVED_AT ranks, loaded at LOADED_AT", saved),
            ("LOADED_AT", str(size), "", None),
            ("TRAINED", str(config.saved_after_forward), "saved after one training forward",
             config.saved_after_forward),
            ("LAYERS", str(spec.scenario == "layers"), "", spec.scenario == "layers"),
            ("BLOCK", str(spec.scenario == "block"), "", spec.scenario == "block"),
            ("NESTED", str(config.nested), "", config.nested),
            ("RESET", str(spec.impl.startswith("te")), "", spec.impl.startswith("te")),
            ("FLOAT8_WIRE", str(not spec.impl.startswith("te")), "", not spec.impl.startswith("te")),
            ("DELAYED", str(spec.impl == "te:delayed"), "", spec.impl == "te:delayed"),
            ("PRECOMPUTE", str(spec.impl == "torchao:precompute"), "", spec.impl == "torchao:precompute"),
            ("STEPS", str(_STEPS.get(spec.scenario, 0)), "SGD steps (lr 0.05, momentum 0.9), each followed by a "
             "re-gather", _STEPS.get(spec.scenario, 0)),
            ("REQUANTIZE_FIRST", str(spec.scenario == "steps"),
             "re-quantize every shard from its unchanged rows before the first all-gather", spec.scenario == "steps"),
            ("REFUSALS", repr(_refusals(spec)), "(error class, message prefix)",
             _refusals(spec)),
            ("DATA_MOVED", "threading.Event()", "set by FSDP2's first all-gather or a step: no refusal after it",
             None),
            ("TIMEOUT_S", 'int(os.environ.get("REPRO_TIMEOUT_S", "30"))',
             "every rank's deadline (a rank still waiting then: HANG)", None)]
    return tuple(rows)


def _refusals(spec: CaseSpec) -> tuple[tuple[str, str], ...]:
    """REFUSALS: (class name, message prefix) of each error the implementation declares as its refusal
    (qgather's `rejection_types`; the reference's classes travel with its script, under the same names),
    matched by a script against every class of a raised error. None where qgather's policy accepts no
    refusal of the case (every shard aligned): a refusal there fails the case, and the script says ERROR."""
    # deferred: the registry and the policy import torch and the adapters
    from qgather.impls import get_impl
    from qgather.impls.rejections import DeclaredRejections
    from qgather.model.policy import expectation

    if expectation(spec).aligned:
        return ()
    declared = DeclaredRejections.of(get_impl(spec.impl).rejection_types, spec.impl)
    return tuple(sorted([(c.__name__, "") for c in declared.classes] + list(declared.names)))


def _weights(spec: CaseSpec) -> str:
    """WEIGHTS: the case's one weight, or the weights of its layers or block module (those of the case's
    format the library holds: qgather leaves the others out of the module too)."""
    if spec.scenario not in _MODULES:
        return f'{{"weight": ({tuple(spec.shape)!r}, {spec.seed}, 1.0)}}'
    weights = block_params(spec).quantized if spec.scenario == "block" else layer_weights(spec)
    held = [w for w in weights if w.spec.fmt == spec.fmt and (spec.impl == "reference" or len(w.spec.shape) == 2)]
    return "{" + ", ".join(f'"{w.name}": ({tuple(w.spec.shape)!r}, {w.spec.seed}, {w.scale})' for w in held) + "}"


def _param_class(spec: CaseSpec) -> type:
    """The reference's parameter class."""
    # deferred: the registry imports torch and the adapters, which a TE or torchao script never needs
    from qgather.impls import get_impl

    impl = get_impl(spec.impl)
    if spec.fmt not in impl.formats or spec.fmt not in bundle.reference_formats():
        raise UnsupportedCase(f"{spec.id}: no standalone script: {spec.impl} does not implement {spec.fmt}")
    return type(impl).param_class
