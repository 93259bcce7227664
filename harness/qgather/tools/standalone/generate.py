"""A case as a standalone script: `render(case_id)` is the text `qgather repro ID --standalone`
writes, made of the functions in qgather.tools.standalone.pieces (copied with inspect.getsource,
docstrings dropped and each `if` on the case's constants decided, so the script runs the code the
tests check, less the branches its case does not take) and the case's constants.

One template per library route, its FSDP2 configuration decided by the case's constants: torchao's
float8 all-gather (fp8_tensor, torchao and torchao:precompute), TransformerEngine's FSDP2 route (te:
fp8_tensor with Float8CurrentScaling, fp8_block with Float8BlockScaling; te:delayed: DelayedScaling)
and qgather's reference subclass (every built-in format; carried as source), each over the gather,
steps, reshard, layers and block scenarios and every configuration token (mp-*, raf-*, hsdp-RxS,
tp-DxT[-row], dim1, compile, dcp-wsA[-trained], nested). Any other case id is refused in one line
saying why (`UnsupportedCase`).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from types import ModuleType

from qgather.errors import UsageError
from qgather.model.block import block_params
from qgather.model.case import CaseSpec
from qgather.model.layers import layer_weights
from qgather.tools.standalone import bundle
from qgather.tools.standalone.pieces import (
    data,
    evidence,
    fp8_block,
    fp8_tensor,
    fsdp,
    launch,
    reference,
    routes,
    scenario,
)

__all__ = ["MAX_LINES", "UnsupportedCase", "how_to_run", "readable_lines", "render"]

#: The most lines a script has before SOURCES (what a maintainer reads; SOURCES is the carried subclass),
#: by library: TE's scripts run under torchrun only; torchao's and the reference's also carry the
#: `python FILE` launcher (forked gloo ranks, ERROR / CRASH / HANG under one deadline).
MAX_LINES = {"transformer_engine": 260, "torchao": 260, "": 280}  # a finding's script: 200 (test_standalone_docs)
_DTYPES = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
_TE_RECIPES = {("te", "fp8_tensor"): "Float8CurrentScaling", ("te", "fp8_block"): "Float8BlockScaling",
               ("te:delayed", "fp8_tensor"): "DelayedScaling"}
_STEPS = {"gather": 0, "steps": 3, "reshard": 1}  # optimizer steps, as qgather.scenarios.fsdp takes them
_MODULES = ("layers", "block")  # a module of several weights (qgather.model.layers, qgather.model.block)
_STDLIB = ("contextlib", "datetime", "hashlib", "importlib", "itertools", "math", "multiprocessing", "os", "re",
           "shutil", "signal", "socket", "sys", "tempfile", "threading", "time", "types")
#: the torch names the pieces import at module level, imported by a script that uses them
_TORCH_NAMES = (("torch.distributed.device_mesh", ("DeviceMesh", "init_device_mesh")),
                ("torch.distributed.fsdp", ("MixedPrecisionPolicy", "fully_shard")),
                ("torch.distributed.tensor", ("Shard",)))
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


def template_for(spec: CaseSpec) -> Template:
    """The template of `spec`, or UnsupportedCase saying in one line why there is none."""
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
    param_class = _param_class(spec)
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


def _constants(spec: CaseSpec) -> tuple[tuple[str, str, str, object], ...]:
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
    constants = (*_constants(spec), *template.constants,
                 ("SPAWN", str(not template.needs_cuda), "python FILE forks gloo ranks", not template.needs_cuda))
    install = "    install(SOURCES)\n" if template.sources else ""
    main = f'if __name__ == "__main__":\n{install}    sys.exit(main())'
    sources = [_sources_block(template.sources), ""] if template.sources else []  # SOURCES last but main
    functions, imports = _hoisted(_functions(spec, template, constants))
    code = "\n".join([*functions, main])  # what the imports serve (SOURCES brings its own)
    body = "\n".join([*functions, *sources, main])
    body = "\n".join([_constant_lines(constants, code), "", body])
    return "\n".join([_header(spec, template, title, note), _imports(code, imports), "", body]) + "\n"


#: the script's sections, in reading order: a comment, then its functions (no blank line between them)
_SECTIONS = (
    ("What the case holds: its weights, drawn as qgather draws them, and FSDP2's split of them",
     ("make_weight", "shard_rows", "tp_piece", "local_part", "masters")),
    ("What it expects: the single-device quantization of the whole weight (qgather's quantizer, inlined)",
     ("quantize", "dequantize", "golden")),
    ("What it builds: the library's own FSDP2 route, configured as the case says",
     ("install", "ReferenceLinear", "fsdp_setup", "sub_mesh", "float8_as_bytes_on_gloo", "layer", "read", "requantize",
      "forward", "Layers", "sharded", "saved_checkpoint")),
    ("What it checks: every unshard's buffers against the golden, bit for bit",
     ("gathered", "unshards", "judge", "compare", "make_input", "compiled")),
    ("Running the ranks under one deadline; the verdict as qgather reports it",
     ("main", "run_rank", "refusal", "refused_on_every_rank", "verdict", "spawn", "_rank", "report")),
)


def _functions(spec: CaseSpec, template: Template, constants) -> list[str]:
    """The script's sections: each a comment and its functions, specialized to the case's constants;
    a function nothing calls is left out."""
    launcher = {"spawn": launch.spawn, "_rank": launch._rank}
    pieces = {"make_weight": data.make_weight, "shard_rows": data.shard_rows, "tp_piece": data.tp_piece,
              "local_part": data.local_part, "masters": data.masters, "quantize": template.golden.quantize,
              "dequantize": template.golden.dequantize, "golden": scenario.golden, "fsdp_setup": fsdp.fsdp_setup,
              "sub_mesh": fsdp.sub_mesh, "float8_as_bytes_on_gloo": fsdp.float8_as_bytes_on_gloo,
              "saved_checkpoint": fsdp.saved_checkpoint,
              **dict(template.functions), "Layers": scenario.Layers, "sharded": scenario.sharded,
              "gathered": _gathered(spec), "judge": scenario.judge, "compare": evidence.compare,
              "unshards": scenario.gathered_steps if spec.scenario in ("steps", "reshard") else scenario.gathered_once,
              "make_input": scenario.make_input, "compiled": scenario.compiled, "main": launch.main,
              "run_rank": launch.run_rank, "refusal": launch.refusal,
              "refused_on_every_rank": launch.refused_on_every_rank, "verdict": launch.verdict, **launcher,
              "report": launch.report}
    known = {name: value for name, _, _, value in constants if value is not None}
    texts = {name: _specialized(_source(function, name), known) for name, function in pieces.items()}
    reached = _called(texts, "main", "install")
    sections = []
    for comment, names in _SECTIONS:
        kept = [texts[name] for name in names if name in reached]
        if kept:
            sections.append(f"# {comment}\n" + "".join(kept))
    return sections


def _gathered(spec: CaseSpec):
    """The scenario's entry: a checkpoint first; the steps' unshards; the first unshard."""
    if spec.config.saved_at_world_size:
        return scenario.gathered_checkpoint
    return scenario.gathered_again if spec.scenario in ("steps", "reshard") else scenario.gathered


def _called(texts: dict[str, str], *roots: str) -> set[str]:
    """The names of `roots` and of every function or class they reach (named in a reached text)."""
    reached, todo = set(), [root for root in roots if root in texts]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        body = re.sub(r"^(def|class) \w+", "", texts[name], count=1, flags=re.M)
        todo += [other for other in texts if other not in reached and re.search(rf"\b{other}\b", body)]
    return reached


def _header(spec: CaseSpec, template: Template, title: str, note: str) -> str:
    what = f"torch and {template.library}" if template.library else (
        "torch (the subclass under test travels as source: SOURCES, at the end)")
    ranks = max(spec.world_size, spec.config.saved_at_world_size or 0)
    run = f"torchrun --nproc-per-node {ranks} FILE" + (
        "" if template.needs_cuda else f" or python FILE ({ranks} gloo ranks, CPU)")
    lines = [title or f"qgather case {spec.id}, standalone", "", *([note, ""] if note else []),
             f"Needs {what}. Run: {run}. Exit 1 with qgather's verdict and evidence while the defect is there, "
             "0 once the gathered buffers equal `quantize`'s."]
    return '"""' + "\n".join(_wrapped(line) for line in lines) + '"""'  # closed on its last line: one line less


def _constant_lines(constants, body: str) -> str:
    """The constants the script's code reads (one a script does not read is left out)."""
    code = re.sub(r"#.*", "", body)
    return "\n".join(f"{name} = {value}" + (f"  # {comment}" if comment else "")
                     for name, value, comment, _ in constants if re.search(rf"\b{name}\b", code))


def _wrapped(line: str) -> str:
    return textwrap.fill(line, width=115, break_on_hyphens=False, break_long_words=False) if line else line


def _imports(body: str, hoisted: list[str]) -> str:
    """The script's imports: the standard library's it uses, torch's, then the functions' own (the library's)."""
    modules = [m for m in _STDLIB if re.search(rf"\b{m}\.", body)]
    wait = ["import multiprocessing.connection"] if "multiprocessing.connection." in body else []
    torch_names = [(module, [n for n in names if re.search(rf"\b{n}\b", body)]) for module, names in _TORCH_NAMES]
    torch_lines = [f"from {module} import {', '.join(names)}" for module, names in torch_names if names]
    torch_lines += sorted({*(line for line in hoisted if re.match(r"(import|from) torch\b", line)),
                           *(["import torch.distributed.checkpoint as dcp"] if re.search(r"\bdcp\.", body) else [])})
    library = sorted(line for line in hoisted if not re.match(r"(import|from) torch\b", line))
    return "\n".join([f"import {', '.join(modules)}", *wait, "", "import torch", "import torch.distributed as dist",
                      *torch_lines, *([""] + library if library else [])])


def _specialized(text: str, known: dict[str, object]) -> str:
    """`text` with each `if COND:` block whose condition reads only the case's constants decided:
    dropped when false, its body in its place when true (the script holds only what its case runs;
    the `if`'s comment goes with the body, and what follows a body that returns is dropped)."""
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
        taken = eval(match[2], {}, dict(known))  # noqa: S307 -- a condition of the pieces' own source, over literals
        body = lines[i + 1:end] if taken else lines[end + 1:end_else] if otherwise else []
        body = _specialized("\n".join(line[4:] for line in body), known).splitlines() if body else []
        if body and taken and match[3]:
            body[0] = _with_comment(body[0], match[3].strip())
        out += body
        i = end_else
        last = next((line for line in reversed(body) if line.strip() and len(line) - len(line.lstrip()) == indent), "")
        if re.match(r"\s*(return|raise)\b", last):
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) >= indent):
                i += 1  # unreachable after the body's return
    return "\n".join(out) + "\n"


def _with_comment(line: str, comment: str) -> str:
    """`line` carrying `comment` (the decided `if`'s why), or the comment above it when that is too long."""
    if "#" not in line and len(line) + len(comment) + 2 <= 120:
        return f"{line}  {comment}"
    return f"{' ' * (len(line) - len(line.lstrip()))}{comment}\n{line}"


def _hoisted(texts: list[str]) -> tuple[list[str], list[str]]:
    """The texts without their function-level imports (a blank line after them goes too), and those
    imports, to stand at the top of the script (the carried `qref` package's stay: it is installed
    at run time)."""
    imports, out = [], []
    for text in texts:
        lines, kept = text.splitlines(), []
        for index, line in enumerate(lines):
            stripped = line.strip()
            if line.startswith(" ") and re.match(r"(import|from) (?!qref)[\w.]+", stripped):
                imports += [stripped] if stripped not in imports else []
                if index + 1 < len(lines) and not lines[index + 1].strip():
                    lines[index + 1] = "\0"  # the blank line after the imports
                continue
            if line != "\0":
                kept.append(line)
        out.append("\n".join(kept) + "\n")
    return out, imports


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
    torchrun = f"torchrun --nproc-per-node {max(spec.world_size, spec.config.saved_at_world_size or 0)} {path}"
    return torchrun if template_for(spec).needs_cuda else f"python {path} or {torchrun}"
