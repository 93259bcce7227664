"""A case as a standalone script: `render(case_id)` is the text `qgather repro ID --standalone`
writes, assembled here from its template (qgather.tools.standalone.templates: the route's pieces and
the case's constants) and the functions in qgather.tools.standalone.pieces, each as the script holds
it (qgather.tools.standalone.specialize: docstrings dropped and each `if` on the case's constants
decided, so the script runs the code the tests check, less the branches its case does not take), in
sections a maintainer reads top to bottom, under a docstring that says how to run it.
"""

from __future__ import annotations

import re
import textwrap

from qgather.model.case import CaseSpec
from qgather.tools.standalone import bundle
from qgather.tools.standalone.pieces import data, evidence, fsdp, launch, scenario
from qgather.tools.standalone.specialize import hoisted, source_of, specialized
from qgather.tools.standalone.templates import Template, case_constants, template_for

__all__ = ["MAX_LINES", "how_to_run", "readable_lines", "render"]

#: The most lines a script has before SOURCES (what a maintainer reads; SOURCES is the carried subclass),
#: by library: TE's scripts run under torchrun only; torchao's and the reference's also carry the
#: `python FILE` launcher (forked gloo ranks, ERROR / CRASH / HANG under one deadline).
MAX_LINES = {"transformer_engine": 260, "torchao": 260, "": 280}  # a finding's script: 200 (test_standalone_docs)
_STDLIB = ("contextlib", "datetime", "hashlib", "importlib", "itertools", "math", "multiprocessing", "os", "re",
           "shutil", "signal", "socket", "sys", "tempfile", "threading", "time", "types")
#: the torch names the pieces import at module level, imported by a script that uses them
_TORCH_NAMES = (("torch.distributed.device_mesh", ("DeviceMesh", "init_device_mesh")),
                ("torch.distributed.fsdp", ("MixedPrecisionPolicy", "fully_shard")),
                ("torch.distributed.tensor", ("Shard",)))
def render(case_id: str, title: str = "", note: str = "", *, param_class: type | None = None) -> str:
    """The standalone script of `case_id` (imports: torch, the library, the standard library).

    Args:
        case_id: a qgather case id a template covers (`template_for`).
        title: what the script shows (a finding's title), its docstring's first line.
        note: more of the docstring (the finding in a sentence or two).
        param_class: a reference case's parameter class in place of the reference's (`template_for`).

    Example:
        >>> text = render("torchao:fp8_tensor:5x64:bf16:ws2:gather:s0")
        >>> "import qgather" in text
        False
    """
    spec = CaseSpec.parse(case_id)
    template = template_for(spec, param_class)
    constants = (*case_constants(spec), *template.constants,
                 ("SPAWN", str(not template.needs_cuda), "python FILE forks gloo ranks", not template.needs_cuda))
    install = "    install(SOURCES)\n" if template.sources else ""
    main = f'if __name__ == "__main__":\n{install}    sys.exit(main())'
    sources = [_sources_block(template.sources), ""] if template.sources else []  # SOURCES last but main
    functions, imports = hoisted(_functions(spec, template, constants))
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
    texts = {name: specialized(source_of(function, name), known) for name, function in pieces.items()}
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
