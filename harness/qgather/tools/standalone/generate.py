"""A case as a standalone script: `render(case_id)` is the text `qgather repro ID --standalone`
writes, made of the functions in qgather.tools.standalone.pieces (copied with inspect.getsource,
docstrings dropped and each `if` on the case's constants decided, so the script runs the code the
tests check, less the branches its case does not take) and the case's constants.

Templates exist per library route and format: torchao's float8 all-gather (fp8_tensor; FSDP2
alone or with torchao's colwise tensor parallelism, the gather scenario), TransformerEngine's FSDP2
route (fp8_tensor with Float8CurrentScaling, fp8_block with Float8BlockScaling; gather, steps and
reshard; Shard(0) or Shard(1) for gather) and the reference or a zoo mutant (gather, steps and
reshard at FSDP2's defaults). Any other case id is refused in one line (`UnsupportedCase`).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass, replace
from types import ModuleType

from qgather.errors import UsageError
from qgather.model.case import CaseSpec
from qgather.tools.standalone import bundle
from qgather.tools.standalone.pieces import data, evidence, fp8_block, fp8_tensor, launch, reference, routes, scenario

__all__ = ["MAX_LINES", "UnsupportedCase", "how_to_run", "readable_lines", "render"]

#: The most lines a script has before SOURCES (what a maintainer reads; SOURCES is the carried subclass),
#: by library: TE's scripts run under torchrun only; torchao's also carry the `python FILE` launcher
#: (forked gloo ranks, ERROR / CRASH / HANG under one deadline); the reference's its route's helpers.
MAX_LINES = {"transformer_engine": 180, "torchao": 205, "": 235}
_DTYPES = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
_TE_RECIPES = {"fp8_tensor": "Float8CurrentScaling", "fp8_block": "Float8BlockScaling"}
_STEPS = {"gather": 0, "steps": 3, "reshard": 1}  # optimizer steps, as qgather.scenarios.fsdp takes them
_EVIDENCE = (evidence.compare, evidence.row_ranges, launch.main, launch.run_rank, launch.verdict)
_STDLIB = ("contextlib", "datetime", "hashlib", "importlib", "itertools", "multiprocessing", "os", "signal", "socket",
           "sys", "threading", "time", "types")


class UnsupportedCase(UsageError):
    """A case id no standalone template covers (the message says what is covered)."""


@dataclass(frozen=True)
class Template:
    """What a script is made of: the library, the route's functions (script name -> piece) and the golden."""

    library: str  # the import name the script needs besides torch ("": none)
    functions: tuple[tuple[str, object], ...]  # (name in the script, a function of pieces), in order
    golden: ModuleType  # pieces.fp8_tensor, pieces.fp8_block or pieces.reference
    constants: tuple[tuple[str, str, str], ...]  # (name, value source, comment) of the route's own constants
    needs_cuda: bool
    sources: dict[str, str] | None = None  # reference/mutant: qgather's modules the script carries (bundle)


_COVERED = ("covered: torchao[:precompute]:fp8_tensor (gather; FSDP2 defaults or tp-DxT), te:fp8_tensor / "
            "te:fp8_block (gather, steps, reshard; FSDP2 defaults, dim1 for gather), reference and mutant:<bug> "
            "(gather, steps, reshard; FSDP2 defaults)")


def template_for(spec: CaseSpec) -> Template:
    """The template of `spec`, or UnsupportedCase naming why there is none."""
    for template in (_torchao_template, _reference_template, _te_template):
        found = template(spec)
        if found is not None:
            return found
    config = f" under {spec.config.token}" if not spec.config.is_default else ""
    raise UnsupportedCase(f"{spec.id}: no standalone template for {spec.impl}:{spec.fmt} in the {spec.scenario} "
                          f"scenario{config} ({_COVERED})")


def _torchao_template(spec: CaseSpec) -> Template | None:
    config = spec.config
    colwise_tp_only = config.tp is not None and config.tp_style == "col" and replace(config, tp=None).is_default
    if spec.impl not in ("torchao", "torchao:precompute") or spec.fmt != "fp8_tensor" or len(spec.shape) != 2 or not (
            config.is_default or colwise_tp_only) or spec.scenario != "gather":
        return None
    functions = (("gathered", routes.gathered_torchao), ("float8_as_bytes_on_gloo", routes.float8_as_bytes_on_gloo))
    return Template("torchao", functions, fp8_tensor, (
        ("TP", str(config.tp[1] if config.tp else 1),
         'tensor-parallel size: mesh ("dp", "tp") of (WORLD_SIZE // TP, TP)'),
        ("PRECOMPUTE", str(spec.impl == "torchao:precompute"), "precompute_float8_dynamic_scale_for_fsdp first")),
        needs_cuda=False)


def _reference_template(spec: CaseSpec) -> Template | None:
    if not (spec.impl == "reference" or spec.impl.startswith("mutant:")) or not spec.config.is_default or (
            spec.scenario not in _STEPS):
        return None
    param_class = _param_class(spec)
    functions = (("install", reference.install), ("sharded", reference.sharded_reference),
                 ("read", reference.read_reference), *_scenario(spec, reference.requantize_reference))
    return Template("", functions, reference, (
        ("FORMAT", repr(spec.fmt), "qgather's format name"),
        ("PARAM_CLASS", repr(bundle.class_path(param_class)), "the tensor subclass under test, in SOURCES"),
        *_steps_constants(spec)), needs_cuda=False, sources=bundle.sources(param_class))


def _te_template(spec: CaseSpec) -> Template | None:
    config = spec.config
    dim1_gather = config.shard_dim == 1 and spec.scenario == "gather" and replace(config, shard_dim=0).is_default
    if spec.impl != "te" or spec.fmt not in _TE_RECIPES or len(spec.shape) != 2 or not (
            config.is_default or dim1_gather) or spec.scenario not in _STEPS:
        return None
    functions = (("sharded", routes.sharded_te), ("read", routes.read_te),
                 *_scenario(spec, routes.requantize_te))
    return Template("transformer_engine", functions, fp8_tensor if spec.fmt == "fp8_tensor" else fp8_block, (
        ("RECIPE", repr(_TE_RECIPES[spec.fmt]), "transformer_engine.common.recipe"),
        ("SHARD_DIM", str(config.shard_dim), "FSDP2 shards the weight's rows (0) or columns (1)"),
        *_steps_constants(spec)), needs_cuda=True)


def _scenario(spec: CaseSpec, requantize) -> tuple[tuple[str, object], ...]:
    if spec.scenario == "gather":
        return (("gathered", scenario.gathered_once),)
    return ("requantize", requantize), ("gathered", scenario.gathered_steps)


def _steps_constants(spec: CaseSpec) -> tuple[tuple[str, str, str], ...]:
    if spec.scenario == "gather":
        return ()
    return (("STEPS", str(_STEPS[spec.scenario]), "SGD steps (lr 0.05, momentum 0.9), each followed by a re-gather"),
            ("REQUANTIZE_FIRST", str(spec.scenario == "steps"),
             "re-quantize every shard from its unchanged rows before the first all-gather"))


def _param_class(spec: CaseSpec) -> type:
    """The reference's or the mutant's parameter class; UnsupportedCase for a bug in the adapter."""
    # deferred: the registry imports torch and the adapters, which a TE or torchao script never needs
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
    install = "    install(SOURCES)\n" if template.sources else ""
    main = f'if __name__ == "__main__":\n{install}    sys.exit(main())'
    sources = [_sources_block(template.sources), ""] if template.sources else []  # SOURCES last but main
    body = "\n".join([*_functions(template), *sources, main])
    body = "\n".join([_constants(spec, template, body), "", body])
    return "\n".join([_header(spec, template, title, note), _imports(template, body), "", body]) + "\n"


def _functions(template: Template) -> list[str]:
    """The script's functions in reading order (data, golden, route, evidence, launcher), each
    specialized to the case's constants; `shard_rows` only where something calls it."""
    launcher = [("spawn", launch.torchrun_only)] if template.needs_cuda else [("spawn", launch.spawn),
                                                                               ("_rank", launch._rank)]
    named = [("make_weight", data.make_weight), ("shard_rows", data.shard_rows),
             ("quantize", template.golden.quantize), ("dequantize", template.golden.dequantize),
             *template.functions, *((f.__name__, f) for f in _EVIDENCE), *launcher, ("report", launch.report)]
    known = {name: ast.literal_eval(value) for name, value, _ in template.constants}
    functions = [_specialized(_source(function, name), known) for name, function in named]
    if not any("shard_rows(" in text for text in functions[2:]):
        del functions[1]
    return functions


def _header(spec: CaseSpec, template: Template, title: str, note: str) -> str:
    what = f"torch, {template.library} and the standard library" if template.library else (
        "torch and the standard library (the subclass under test travels as source: SOURCES, at the end)")
    run = f"torchrun --nproc-per-node {spec.world_size} FILE" + (
        "" if template.needs_cuda else f" or python FILE ({spec.world_size} gloo ranks on the CPU)")
    lines = [title or f"qgather case {spec.id}, standalone", "", *([note, ""] if note else []),
             f"qgather case {spec.id} without qgather: {what}. Run: {run}. It prints the verdict and the "
             "evidence of qgather's report: exit 1 while the defect is there, 0 once every gathered buffer "
             "equals the single-device quantization (qgather's reference quantizer, inlined) bit for bit."]
    return '"""' + "\n".join(_wrapped(line) for line in lines) + '\n"""'


def _wrapped(line: str) -> str:
    return textwrap.fill(line, width=110, break_on_hyphens=False, break_long_words=False) if line else line


def _imports(template: Template, body: str) -> str:
    modules = [m for m in _STDLIB if re.search(rf"\b{m}\.", body)]
    wait = ["from multiprocessing.connection import wait"] if "wait(" in body else []
    return "\n".join([f"import {', '.join(modules)}", *wait, "", "import torch", "import torch.distributed as dist"])


def _constants(spec: CaseSpec, template: Template, body: str) -> str:
    """The constants the script's code reads (a route's constant its case does not use is left out)."""
    rows = [("CASE", repr(spec.id), ""),
            ("SHAPE", repr(tuple(spec.shape)), "the weight (out_features, in_features)"),
            ("SEED", str(spec.seed), "the weight is drawn from it exactly as qgather draws it"),
            ("DTYPE", _DTYPES[spec.dtype], ""),
            ("WORLD_SIZE", str(spec.world_size), ""),
            *template.constants,
            ("TIMEOUT_S", 'int(os.environ.get("REPRO_TIMEOUT_S", "120"))',
             "every rank's deadline (a rank still waiting then: HANG)")]
    return "\n".join(f"{name} = {value}" + (f"  # {comment}" if comment else "") for name, value, comment in rows
                     if re.search(rf"\b{name}\b", re.sub(r"#.*", "", body)))


def _specialized(text: str, known: dict[str, object]) -> str:
    """`text` with each `if COND:` block whose condition reads only the case's constants decided:
    dropped when false, its body in its place when true (the script holds only what its case runs)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        match = re.fullmatch(r"(\s*)if (.+?):(\s+#.*)?", lines[i])
        names = match and {n.id for n in ast.walk(ast.parse(match[2], mode="eval")) if isinstance(n, ast.Name)}
        if not match or not names or not names <= known.keys():
            out.append(lines[i])
            i += 1
            continue
        indent = len(match[1])
        end = _block_end(lines, i + 1, indent)
        otherwise = end < len(lines) and lines[end] == f"{match[1]}else:"
        end_else = _block_end(lines, end + 1, indent) if otherwise else end
        if eval(match[2], {}, dict(known)):  # noqa: S307 -- a condition of the pieces' own source, over literals
            out += [line[4:] for line in lines[i + 1:end]]
        elif otherwise:
            out += [line[4:] for line in lines[end + 1:end_else]]
        i = end_else
    return "\n".join(out) + "\n"


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the block that starts at `start`, indented deeper than `indent`."""
    end = start
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():  # a blank line after a block belongs to what follows
        end -= 1
    return end


def _source(function, name: str) -> str:
    """The function's source as the script holds it: named `name`, without its docstring (a `# why`
    comment stays) and without the pieces' ruff pragmas."""
    text = inspect.getsource(function)
    tree = ast.parse(text)
    node = tree.body[0]
    lines = text.splitlines()
    first = ast.get_docstring(node, clean=False) is not None and node.body[0]
    if first:
        del lines[first.lineno - 1:first.end_lineno]
        if lines[first.lineno - 1:first.lineno] == [""]:  # the blank line after a docstring goes too
            del lines[first.lineno - 1]
    text = re.sub(r"# noqa: [A-Z0-9, ]+(-- )?", "# ", "\n".join(lines) + "\n")  # the comment's why stays
    return text.replace(f"def {function.__name__}(", f"def {name}(", 1)


def _sources_block(sources: dict[str, str]) -> str:
    """SOURCES, last in the script: the readable part comes first."""
    lines = [f"# qgather's reference subclass and formats, copied, with `qgather.` renamed `{bundle.PACKAGE}.` "
             "(the script imports no qgather)", "SOURCES = {"]
    for name, text in sources.items():
        lines.append(f"    {name!r}: r'''{text}''',")
    return "\n".join([*lines, "}"])


def readable_lines(text: str) -> int:
    """Lines of a script before its SOURCES (all of them for a library's script)."""
    return len(text.split("\nSOURCES = {", 1)[0].splitlines())


def how_to_run(case_id: str, path: str) -> str:
    """The command(s) that run the script of `case_id` written at `path`."""
    spec = CaseSpec.parse(case_id)
    torchrun = f"torchrun --nproc-per-node {spec.world_size} {path}"
    return torchrun if template_for(spec).needs_cuda else f"python {path} or {torchrun}"
