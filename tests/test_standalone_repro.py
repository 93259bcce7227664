"""`qgather repro ID --standalone`: scripts with no qgather in them (qgather.tools.standalone).

The pieces a script is made of are checked against qgather's own code (the weight, the reference
quantizers), every template renders a script that compiles, defines every name it uses and imports
only torch, its library and the standard library, and the CLI writes it or refuses in one line.
Running the CPU scripts against `qgather case` is tests/test_standalone_agreement.py."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from qgather.formats import FORMATS
from qgather.model.case import CaseSpec
from qgather.scenarios.data import make_gradient, make_weight
from qgather.tools.standalone import UnsupportedCase, render
from qgather.tools.standalone.findings import FINDINGS
from qgather.tools.standalone.generate import MAX_LINES, readable_lines
from qgather.tools.standalone.pieces import data, evidence, fp8_block, fp8_tensor, launch
from qgather.tools.standalone.templates import template_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = ("torchao:precompute:fp8_tensor:5x64:fp32:ws2:gather:s1", "te:fp8_tensor:128x64:fp32:ws4:gather:s2",
       "reference:nvfp4_2d:136x64:bf16:ws2:gather:s0", "reference:mxfp8:64x64:fp32:ws4:gather:s1",
       "reference:nvfp4_1d:136x64:bf16:ws8:gather:s0", "reference:fp8_tensor:128x64:bf16:ws2:reshard:s0",
       "reference:fp8_block:255x64:bf16:ws2:block:s0:nested", "te:fp8_block:200x256:fp32:ws2:reshard:s1",
       "te:fp8_tensor:128x64:bf16:ws2:steps:s0", "te:fp8_block:1024x256:bf16:ws2:gather:s0:dim1",
       "torchao:fp8_tensor:31x128:bf16:ws2:steps:s0:mp-fp32+raf-no+compile+dcp-ws4",
       "reference:fp8_tensor_e5m2:128x64:bf16:ws4:gather:s0:tp-2x2-row",
       *(finding.case_id for finding in FINDINGS if finding.case_id and not finding.probe))
STDLIB = set(sys.stdlib_module_names)
SHAPES = ("1x16", "5x64", "128x64", "200x256", "255x130", "3x384")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ("bf16", "fp32"))
def test_weight_and_goldens_are_qgathers_bit_for_bit(shape, dtype):
    spec = CaseSpec.parse(f"reference:fp8_tensor:{shape}:{dtype}:ws1:gather:s3")
    weight = make_weight(spec, dtype=spec.torch_dtype)
    assert torch.equal(data.make_weight(spec.shape, spec.seed, spec.torch_dtype), weight)
    for piece, name in ((fp8_tensor, "fp8_tensor"), (fp8_block, "fp8_block")):
        reference = FORMATS[name].quantize(weight)
        golden = piece.quantize(weight, weight.abs().amax())
        for buffer, value in golden.items():
            expected = reference.buffers[buffer][reference.valid[buffer]]
            assert value.shape == expected.shape and torch.equal(value.view(torch.uint8), expected.view(torch.uint8)), (
                name, buffer)
        assert torch.equal(piece.dequantize(golden, spec.shape), FORMATS[name].dequantize(reference)), name


def test_golden_catches_a_changed_bit():
    weight = data.make_weight((128, 64), 0, torch.bfloat16)
    golden = fp8_block.quantize(weight, weight.abs().amax())
    reference = FORMATS["fp8_block"].quantize(weight.clone().index_fill_(0, torch.tensor([3]), 1.0))
    assert not torch.equal(golden["rowwise_data"], reference.buffers["rowwise_data"])


@pytest.mark.parametrize("step", (1, 3))
def test_the_steps_gradient_is_qgathers(step):
    spec = CaseSpec.parse("reference:fp8_tensor:136x64:bf16:ws2:steps:s4")
    assert torch.equal(data.make_weight(spec.shape, spec.seed * 1000 + step, torch.float32), make_gradient(spec, step))


def test_weight_of_a_3d_case_is_qgathers():
    spec = CaseSpec.parse("reference:nvfp4_2d:3x16x64:bf16:ws2:gather:s5")
    assert torch.equal(data.make_weight(spec.shape, spec.seed, spec.torch_dtype),
                       make_weight(spec, dtype=spec.torch_dtype))


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 8))
def test_shard_rows_are_fsdp2s_chunks(world_size):
    for rows in (1, 5, 31, 128, 200):
        chunks = torch.arange(rows).chunk(world_size)
        for rank in range(world_size):
            got = torch.arange(rows)[data.shard_rows(rows, world_size, rank)]
            want = chunks[rank] if rank < len(chunks) else torch.arange(0)
            assert torch.equal(got, want), (rows, world_size, rank)


@pytest.mark.parametrize("case_id", IDS)
def test_script_imports_only_torch_its_library_and_the_stdlib(case_id, tmp_path):
    text = render(case_id)
    tree = ast.parse(text)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    library = {"torchao": {"torchao"}, "te": {"transformer_engine"}}.get(case_id.split(":")[0], {"qref"})
    assert imported - STDLIB == {"torch", *library}
    if library == {"qref"}:  # the reference's or a mutant's subclass: qgather's modules carried as source
        assert "'qref.impls.reference.param': r" in text and "install(SOURCES)" in text
    path = tmp_path / "r.py"
    path.write_text(text)
    subprocess.run([sys.executable, "-m", "py_compile", str(path)], check=True, timeout=60)
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F,E9",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout  # every name the script uses is defined in it


def test_script_carries_the_case():
    text = render("torchao:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2")
    for line in ("WEIGHTS = {\"weight\": ((128, 64), 0, 1.0)}", "DTYPE = torch.bfloat16", "WORLD_SIZE = 4", "TP = 2",
                 "def gathered(", "parallelize_module(linear"):
        assert line in text


def test_script_holds_only_what_its_case_runs():
    """`if CONSTANT:` blocks of the pieces are decided for the case: no TP code without TP, no
    precompute call without it, no Shard(1) at dim 0, no step code in a gather script, no checkpoint
    without dcp-wsA; and a configuration's code where its token is."""
    plain = render("torchao:fp8_tensor:5x64:bf16:ws2:gather:s0")
    for absent in ("parallelize_module", "precompute_float8", "TP", "PRECOMPUTE", "SAVED_AT", "dcp", "Shard(1)",
                   "MixedPrecisionPolicy", "torch.compile", "requantize", "STEPS", "LAYERS", "reshard_after_forward"):
        assert absent not in plain, absent
    assert "if " not in plain.split("def gathered(")[1].split("\ndef ")[0]
    assert "precompute_float8_dynamic_scale_for_fsdp(root)" in render(
        "torchao:precompute:fp8_tensor:5x64:bf16:ws2:gather:s0")
    dim0 = render("te:fp8_block:200x256:bf16:ws2:gather:s0")
    dim1 = render("te:fp8_block:1024x256:bf16:ws2:gather:s0:dim1")
    assert "Shard(1)" not in dim0 and "SHARD_DIM" not in dim0 and "lambda param: Shard(1)" in dim1
    assert "requantize" not in dim0 and "STEPS" not in dim0
    assert "_rowwise_data" not in render("te:fp8_tensor:128x64:bf16:ws2:steps:s0")
    configured = render("torchao:fp8_tensor:31x128:bf16:ws2:steps:s0:mp-fp32+raf-no+compile+dcp-ws4")
    for present in ("MixedPrecisionPolicy(param_dtype=MP", "reshard_after_forward", "torch.compile(root",
                    "dcp.save(", "dcp.load(", "SAVED_AT = 4", "LOADED_AT = 2", "WORLD_SIZE = 4", "requantize("):
        assert present in configured, present
    hsdp = render("reference:fp8_tensor:128x64:bf16:ws4:gather:s0:hsdp-2x2")
    assert '("replicate", "shard")' in hsdp and "HSDP = 2" in hsdp
    block = render("reference:fp8_block:255x64:bf16:ws2:block:s0:nested")
    assert '"first": ((255, 64)' in block and '"experts": ((4, 128, 64)' in block and "root.scale" in block


@pytest.mark.parametrize(("case_id", "why"), (
    ("mutant:per_rank_amax:nvfp4_2d:128x64:bf16:ws2:gather:s0", "zoo mutant"),
    ("te:nvfp4_2d:128x64:bf16:ws2:gather:s0", "no inlined golden"),
    ("te:prequantized:fp8_block:1024x64:bf16:ws2:gather:s0", "bytes on the wire"),
    ("reference:fp8_tensor:128x64:bf16:ws2:hooks:s0", "emulates FSDP2"),
    ("reference:fp8_tensor:128x64:bf16:ws2:virtual:s0", "virtual ranks"),
    ("te:delayed:fp8_tensor:256x512:bf16:ws1:model:s0", "one-GPU twin"),
    ("torchao:fp8_tensor:4x1x64:bf16:ws2:gather:s0", "SKIPs"),
    ("te:fp8_tensor:16x64:bf16:ws2:layers:s0", "SKIPs"),
))
def test_cases_without_a_script_are_refused_in_one_line_saying_why(case_id, why):
    with pytest.raises(UnsupportedCase, match=f"^{re.escape(case_id)}: no standalone script: .*{why}") as refused:
        render(case_id)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("case_id", (
    "torchao:fp8_tensor:128x64:bf16:ws2:steps:s0", "te:fp8_tensor:128x64:bf16:ws2:steps:s0:dim1",
    "te:fp8_block:1024x64:bf16:ws2:gather:s0:dcp-ws3", "torchao:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2-row",
    "te:delayed:fp8_tensor:128x64:bf16:ws4:gather:s0:dcp-ws2-trained",
    "te:fp8_tensor:128x64:fp32:ws2:reshard:s0:tp-1x2",
    "reference:nvfp4_1d:1x2x16:bf16:ws2:gather:s0:compile+dcp-ws4", "reference:fp8_tensor:16x64:bf16:ws1:layers:s0",
    "torchao:fp8_tensor:17x64:fp32:ws2:block:s0:mp-bf16",
    "reference:mxfp8:32x64:fp32:ws2:reshard:s0:mp-bf16-rfp32+raf-no+hsdp-1x2+dim1",
))
def test_every_configuration_token_and_scenario_has_a_script(case_id):
    """gather, steps, reshard, layers, block; mp-*, raf-*, hsdp, tp(-row), dim1, compile, dcp-wsA(-trained)."""
    text = render(case_id)
    compile(text, case_id, "exec")


def qgather(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "harness")}
    return subprocess.run([sys.executable, "-m", "qgather", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def test_cli_writes_the_script_and_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    """`qgather repro --standalone -o` writes the script, in a process of its own from the folder it names; the
    printed script and the refusals through repro's own main in this process, in that folder (one line on
    stderr each and exit 4; --standalone starts no pool, and repro's main, unlike the command line's dispatch,
    leaves this process's pools alone)."""
    from qgather.cli.case import main_repro

    case_id = "te:fp8_block:200x256:bf16:ws2:gather:s0"
    written = qgather("repro", case_id, "--standalone", "-o", "r.py", cwd=str(tmp_path))
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "r.py").read_text() == render(case_id)
    monkeypatch.chdir(tmp_path)
    assert main_repro([case_id, "--standalone"]) == 0
    assert capsys.readouterr().out == render(case_id)
    for args in (("mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0", "--standalone"),
                 ("not-an-id", "--standalone"), (case_id, "-o", "r.py"),
                 (case_id, "--standalone", "-o", str(tmp_path / "missing" / "r.py"))):
        rc = main_repro(list(args))
        out, err = capsys.readouterr()
        assert rc == 4 and out == "", args
        assert len(err.strip().splitlines()) == 1 and err.startswith("qgather repro: "), (args, err)


def _result(rank: int, label: str = "unshard 1", lines: tuple[str, ...] = (), digest: str = "d") -> list[dict]:
    return [{"rank": rank, "label": label, "lines": list(lines), "digest": digest}]


def test_verdict_names_the_verdict_and_groups_ranks_that_agree():
    assert launch.verdict([_result(0), _result(1)]) == ("EXACT", [])
    verdict, lines = launch.verdict([_result(0, lines=("data: 3 of 8 valid elements differ",)),
                                     _result(1, lines=("data: 3 of 8 valid elements differ",))])
    assert (verdict, lines) == ("SILENT_MISMATCH", ["ranks 0, 1: unshard 1: data: 3 of 8 valid elements differ"])
    assert launch.verdict([_result(0), _result(1, digest="e")])[0] == "RANK_DIVERGENCE"
    # different TP pieces hold different bytes: not a divergence
    assert launch.verdict([_result(0, "tp rank 0 of 2"), _result(1, "tp rank 1 of 2", digest="e")])[0] == "EXACT"


class ShardAlignmentError(ValueError):
    pass


class NarrowerAlignmentError(ShardAlignmentError):
    pass


def test_a_refusal_is_a_declared_error_raised_before_any_data_moved(monkeypatch):
    """qgather's REJECTED rule as the scripts apply it: a declared class (any class of the error) or a
    "class: message prefix", and only until FSDP2's first all-gather (or a step) set DATA_MOVED."""
    moved = threading.Event()
    monkeypatch.setattr(launch, "DATA_MOVED", moved, raising=False)
    monkeypatch.setattr(launch, "REFUSALS", (("AssertionError", "FSDP2 requires"), ("ShardAlignmentError", "")),
                        raising=False)
    assert launch.refusal(NarrowerAlignmentError("shard 1 starts at row 10\n  detail")) == (
        "NarrowerAlignmentError: shard 1 starts at row 10")
    assert launch.refusal(AssertionError("FSDP2 requires M % 16")) == "AssertionError: FSDP2 requires M % 16"
    assert launch.refusal(AssertionError("another assertion")) == ""
    assert launch.refusal(IndexError("list index out of range")) == ""
    moved.set()
    assert launch.refusal(ShardAlignmentError("shard 1 starts at row 10")) == ""
    moved.clear()
    monkeypatch.setattr(launch, "REFUSALS", (), raising=False)  # a case every shard of which is aligned
    assert launch.refusal(ShardAlignmentError("shard 1 starts at row 10")) == ""


def test_torchrun_ranks_compare_their_refusals_in_the_store(monkeypatch):
    """Each rank that raised posts its refusal ("" for another error); REJECTED needs every rank's, alike
    but for the numbers (each rank names its own shard)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setattr(launch, "WORLD_SIZE", 2, raising=False)
    store.set("refused/1", "ShardAlignmentError: shard 1 of 2 has 10 rows")
    assert launch.refused_on_every_rank(0, "ShardAlignmentError: shard 0 of 2 has 11 rows")
    assert not launch.refused_on_every_rank(0, "FormatError: another refusal")
    store.set("refused/1", "")  # rank 1 raised an error that is no refusal
    assert not launch.refused_on_every_rank(0, "ShardAlignmentError: shard 0 of 2 has 11 rows")


def test_verdict_is_the_first_unshard_that_fails():
    second = {"rank": 0, "label": "unshard 2 (after step 1)", "lines": ["data: 1 of 8 valid elements differ"],
              "digest": "d"}
    every = [_result(0) + [second], _result(1) + [{**second, "rank": 1}]]
    assert launch.verdict(every) == ("SILENT_MISMATCH", [
        "ranks 0, 1: unshard 2 (after step 1): data: 1 of 8 valid elements differ"])


@pytest.mark.parametrize("case_id", IDS)
def test_script_is_short(case_id):
    """What a maintainer reads (everything before a reference subclass's SOURCES) stays within the limit."""
    limit = MAX_LINES[template_for(CaseSpec.parse(case_id)).library]
    assert readable_lines(render(case_id)) <= limit  # the findings' scripts, with their notes: test_standalone_docs


def test_compare_counts_valid_elements_and_names_the_rows(monkeypatch):
    monkeypatch.setattr(evidence, "dequantize", fp8_block.dequantize, raising=False)  # the script's golden
    weight = data.make_weight((200, 256), 0, torch.bfloat16)
    want = fp8_block.quantize(weight, weight.abs().amax())
    got = fp8_block.quantize(weight.clone().index_fill_(0, torch.tensor([3, 4, 150]), 0.0), weight.abs().amax())
    lines = evidence.compare(got, want, (200, 256), row0=0)
    assert lines[0].startswith("rowwise_data: ") and lines[0].endswith(" of 51200 valid elements differ")
    scales = {**want, "rowwise_scale_inv": want["rowwise_scale_inv"].clone().index_fill_(1, torch.tensor([1]), 2.0)}
    assert evidence.compare(scales, want, (200, 256), row0=0)[0] == (
        "rowwise_scale_inv: 2 of 4 valid elements differ")  # float32 elements, not their bytes
    assert lines[-1].endswith("rows 3-150")
    assert evidence.compare(want, want, (200, 256), row0=0) == []
    wrong_shape = {**want, "rowwise_data": want["rowwise_data"][:100]}
    assert evidence.compare(wrong_shape, want, (200, 256), row0=0)[0] == (
        "rowwise_data: shape (100, 256), expected (200, 256)")
