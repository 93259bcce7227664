"""A case as a standalone script: `render(case_id)` is the text `qgather repro ID --standalone`
writes, made of the functions in qgather.tools.standalone.pieces (copied with inspect.getsource,
so the script runs exactly the code the tests check) and the case's constants.

Templates exist per library route and format: torchao's float8 all-gather (fp8_tensor; FSDP2
alone or with torchao's colwise tensor parallelism) and TransformerEngine's FSDP2 route
(fp8_tensor with Float8CurrentScaling, fp8_block with Float8BlockScaling), the gather scenario at
FSDP2's default configuration. Any other case id is refused in one line (`UnsupportedCase`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from types import ModuleType

from qgather.errors import UsageError
from qgather.model.case import CaseSpec
from qgather.tools.standalone import bundle
from qgather.tools.standalone.pieces import data, evidence, fp8_block, fp8_tensor, launch, reference, routes

__all__ = ["UnsupportedCase", "render"]

_DTYPES = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
_TE_RECIPES = {"fp8_tensor": "Float8CurrentScaling", "fp8_block": "Float8BlockScaling"}
_LAUNCH = (launch.main, launch.run_rank, launch.spawn, launch._rank_process, launch._verdict, launch.report)
_EVIDENCE = (evidence.compare, evidence.row_ranges, evidence.digest, evidence.judge)
_STDLIB = ("datetime", "hashlib", "multiprocessing", "os", "signal", "socket", "sys", "time")


class UnsupportedCase(UsageError):
    """A case id no standalone template covers (the message says what is covered)."""


@dataclass(frozen=True)
class Template:
    """What a script is made of: the library, its route function and the format's golden."""

    library: str  # the import name the script needs besides torch ("" : none)
    route: object  # a function of pieces.routes, emitted as `gathered`
    golden: ModuleType  # pieces.fp8_tensor or pieces.fp8_block
    constants: tuple[tuple[str, str, str], ...]  # (name, value source, comment) of the route's own constants
    needs_cuda: bool
    helpers: tuple = ()  # more functions the route calls
    sources: dict[str, str] | None = None  # reference/mutant: qgather's modules the script carries (bundle)


_COVERED = ("covered: torchao[:precompute]:fp8_tensor (FSDP2 defaults or tp-DxT), te:fp8_tensor / te:fp8_block, "
            "reference and mutant:<bug> (FSDP2 defaults); the gather scenario")


def template_for(spec: CaseSpec) -> Template:
    """The template of `spec`, or UnsupportedCase naming why there is none."""
    if spec.scenario != "gather":
        raise UnsupportedCase(f"{spec.id}: no standalone template for the {spec.scenario} scenario ({_COVERED})")
    for template in (_torchao_template, _reference_template, _te_template):
        found = template(spec)
        if found is not None:
            return found
    config = f" under {spec.config.token}" if not spec.config.is_default else ""
    raise UnsupportedCase(f"{spec.id}: no standalone template for {spec.impl}:{spec.fmt}{config} ({_COVERED})")


def _torchao_template(spec: CaseSpec) -> Template | None:
    config = spec.config
    colwise_tp_only = config.tp is not None and config.tp_style == "col" and replace(
        config, tp=None).is_default
    if spec.impl not in ("torchao", "torchao:precompute") or spec.fmt != "fp8_tensor" or len(spec.shape) != 2 or not (
            config.is_default or colwise_tp_only):
        return None
    return Template("torchao", routes.gathered_torchao, fp8_tensor, (
        ("TP", str(config.tp[1] if config.tp else 1),
         'tensor-parallel size: a (WORLD_SIZE // TP, TP) ("dp", "tp") mesh'),
        ("PRECOMPUTE", str(spec.impl == "torchao:precompute"),
         "precompute_float8_dynamic_scale_for_fsdp before the all-gather")),
        needs_cuda=False, helpers=(routes.float8_as_bytes_on_gloo,))


def _reference_template(spec: CaseSpec) -> Template | None:
    if not (spec.impl == "reference" or spec.impl.startswith("mutant:")) or not spec.config.is_default:
        return None
    param_class = _param_class(spec)
    return Template("", reference.gathered_reference, reference, (
        ("FORMAT", repr(spec.fmt), "qgather's format name"),
        ("PARAM_CLASS", repr(bundle.class_path(param_class)), "the tensor subclass under test, from SOURCES")),
        needs_cuda=False, helpers=(reference.install,), sources=bundle.sources(param_class))


def _te_template(spec: CaseSpec) -> Template | None:
    if spec.impl != "te" or spec.fmt not in _TE_RECIPES or not spec.config.is_default or len(spec.shape) != 2:
        return None
    return Template("transformer_engine", routes.gathered_te, fp8_tensor if spec.fmt == "fp8_tensor" else fp8_block,
                    (("RECIPE", repr(_TE_RECIPES[spec.fmt]), "transformer_engine.common.recipe"),),
                    needs_cuda=True)


def _param_class(spec: CaseSpec) -> type:
    """The reference's or the mutant's parameter class; UnsupportedCase for a bug in the adapter."""
    from qgather.impls import get_impl
    from qgather.impls.reference import ReferenceImplementation

    impl = get_impl(spec.impl)
    if spec.fmt not in impl.formats or spec.fmt not in bundle.reference_formats():
        raise UnsupportedCase(f"{spec.id}: {spec.impl} does not implement {spec.fmt}")
    adapter = type(impl)
    own = sorted({name for cls in adapter.__mro__[:adapter.__mro__.index(ReferenceImplementation)]
                  for name, value in vars(cls).items()
                  if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))})
    if own:
        raise UnsupportedCase(f"{spec.id}: the bug lives in the adapter ({', '.join(own)}), "
                              "which the script does not carry")
    return adapter.param_class


def render(case_id: str, title: str = "", note: str = "") -> str:
    """The standalone script of `case_id` (imports: torch, the library, the standard library).

    Args:
        case_id: a qgather case id a template covers (`template_for`).
        title: what the script shows (a finding's title), its docstring's first line.
        note: more of the docstring (the finding in a sentence or two).

    Example:
        >>> text = render("torchao:fp8_tensor:5x64:bf16:ws2:gather:s0")
        >>> "import qgather" in text
        False
    """
    spec = CaseSpec.parse(case_id)
    template = template_for(spec)
    parts = [_header(spec, template, title, note), _imports(template), _constants(spec, template)]
    functions = (data.make_weight, data.shard_rows, template.golden.quantize, template.golden.dequantize,
                 template.route, *template.helpers, *_EVIDENCE, *_LAUNCH)
    parts += [_source(f, template) for f in functions]
    main = 'if __name__ == "__main__":\n    sys.exit(main())\n'
    if template.sources is not None:
        parts.append(_sources_block(template.sources))
        main = main.replace("    sys.exit", "    install(SOURCES)\n    sys.exit")
    parts.append(main)
    return "\n\n".join(p.rstrip("\n") for p in parts[:3]) + "\n\n\n" + "\n\n\n".join(
        p.rstrip("\n") for p in parts[3:]) + "\n"


def _header(spec: CaseSpec, template: Template, title: str, note: str) -> str:
    where = ("forks one rank per GPU" if template.needs_cuda
             else f"forks {spec.world_size} gloo ranks on the CPU")
    lines = [title or f"qgather case {spec.id}, standalone", ""]
    if note:
        lines += [note, ""]
    what = f"{template.library} and torch only" if template.library else (
        "torch only; the subclass under test is carried as source (SOURCES, at the end)")
    lines += [f"qgather case {spec.id} without qgather: {what}.",
              f"Run: torchrun --nproc-per-node {spec.world_size} FILE (NCCL on GPUs) or python FILE ({where}).",
              "It prints the verdict and evidence as qgather's report does and exits 1 while the defect",
              "is there, 0 once every rank gathers the single-device quantization bit for bit.",
              "Generated by `qgather repro ID --standalone`; the golden is qgather's reference quantizer."]
    return '"""' + "\n".join(lines) + '\n"""'


def _sources_block(sources: dict[str, str]) -> str:
    """SOURCES, last in the script: the readable part comes first."""
    lines = [f"# qgather's reference subclass and formats, copied, with `qgather.` renamed `{bundle.PACKAGE}.` "
             "(the script imports no qgather)", "SOURCES = {"]
    for name, text in sources.items():
        lines.append(f"    {name!r}: r'''{text}''',")
    return "\n".join([*lines, "}"])


def _imports(template: Template) -> str:
    extra = {routes.float8_as_bytes_on_gloo: ("contextlib",), reference.install: ("importlib", "types")}
    modules = sorted(_STDLIB + tuple(m for helper in template.helpers for m in extra.get(helper, ())))
    return "\n".join([*(f"import {m}" for m in modules), "from multiprocessing.connection import wait", "",
                      "import torch", "import torch.distributed as dist"])


def _constants(spec: CaseSpec, template: Template) -> str:
    rows = [("CASE", repr(spec.id), "the qgather case this reproduces"),
            ("SHAPE", repr(tuple(spec.shape)), "the weight (out_features, in_features)"),
            ("SEED", str(spec.seed), "the weight is drawn from it exactly as qgather does"),
            ("DTYPE", _DTYPES[spec.dtype], "the weight's dtype"),
            ("WORLD_SIZE", str(spec.world_size), "ranks"),
            *template.constants,
            ("LIBRARY_NEEDS_CUDA", str(template.needs_cuda), "python FILE then runs one rank per GPU"),
            ("TIMEOUT_S", "120", "python FILE: every rank's deadline (a rank still waiting then: HANG)")]
    return "\n".join(f"{name} = {value}  # {comment}" for name, value, comment in rows)


def _source(function, template: Template) -> str:
    text = inspect.getsource(function)
    if function is template.route:
        text = text.replace(f"def {function.__name__}(", "def gathered(", 1)
    return text
