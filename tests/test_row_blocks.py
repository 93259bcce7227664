"""Large tensors are quantized and dequantized in row blocks (qgather.formats.base.ROW_BLOCK_ELEMENTS):
the bits must be those of one pass, padding included, for every format and for shapes whose last
block is partial, whose scale tiles are partial, and with more than two dimensions."""

from __future__ import annotations

import pytest
import torch

from qgather.formats import FORMATS, FormatError
from qgather.formats import base as format_base
from qgather.model.case import CaseSpec

SHAPES = [(448, 64), (450, 96), (2, 320, 64), (1000, 128)]
SMALL_BLOCKS = 128 * 64  # elements: blocks of 128 rows for K=64, several blocks per shape


def _weight(shape, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    rows = torch.exp2(torch.linspace(-6, 6, shape[-2])).reshape(-1, 1)
    return (torch.randn(shape, generator=g) * rows).to(dtype)


def _holdable(fmt, shape) -> bool:
    try:
        fmt.check(shape, torch.bfloat16)
    except FormatError:
        return False
    return True


CASES = [(name, shape) for name, fmt in FORMATS.items() for shape in SHAPES if _holdable(fmt, shape)]


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_row_blocks_give_the_bits_of_one_pass(name, shape, monkeypatch):
    fmt, weight = FORMATS[name], _weight(shape)
    whole = fmt.quantize(weight)
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    blocks = fmt.row_blocks(shape)
    assert len(blocks) > 1, "the shape must span several blocks, or the test proves nothing"
    blocked = fmt.quantize(weight)
    assert blocked.mismatches(whole) == []
    dequantized = torch.cat([fmt.dequantize_rows(blocked, start, stop) for start, stop in blocks])
    expected = fmt.dequantize(whole).reshape(dequantized.shape)
    assert torch.equal(dequantized.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.per_tensor and _holdable(f, (448, 64))])
def test_row_blocks_scale_with_the_given_amax(name, monkeypatch):
    fmt, weight = FORMATS[name], _weight((448, 64))
    amax = torch.tensor(3.0 * float(weight.float().abs().max()))
    whole = fmt.quantize(weight, amax=amax)
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    assert fmt.quantize(weight, amax=amax).mismatches(whole) == []


def test_blocks_start_on_whole_scale_blocks(monkeypatch):
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", 1000)
    for fmt in FORMATS.values():
        starts = [start for start, _ in fmt.row_blocks((1024, 16))]
        assert all(start % fmt.row_block_multiple == 0 for start in starts), fmt.name
        assert fmt.row_blocks((1024, 16))[-1][1] == 1024


def test_a_block_that_splits_a_scale_block_is_refused(monkeypatch):
    fmt = FORMATS["fp8_block"]
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    q = fmt.quantize(_weight((448, 64)))
    with pytest.raises(FormatError, match=r"rows \[64, 192\) are not a row block"):
        fmt.dequantize_rows(q, 64, 192)


BLOCKED_CASES = [
    "reference:fp8_block:1024x64:bf16:ws4:gather:s0",
    "reference:nvfp4_1d:512x64:bf16:ws2:gather:s0",
    "mutant:nibble_swap:nvfp4_2d:512x64:bf16:ws2:gather:s0",
    "mutant:scale_padding:nvfp4_2d:512x64:bf16:ws2:gather:s0",
    "mutant:trim_to_fit:nvfp4_1d:520x64:bf16:ws8:gather:s0",
    "mutant:hp_fallback:nvfp4_2d:512x64:bf16:ws2:gather:s0",
]


@pytest.mark.parametrize("case_id", BLOCKED_CASES)
def test_a_case_judged_in_row_blocks_gets_the_same_records(case_id, monkeypatch):
    """Every comparison of a case (values, dequantized weight, outputs, the map of differing rows)
    is the same whether the golden is dequantized whole or in row blocks."""
    from qgather.scenarios.virtual import run_virtual

    whole = run_virtual(CaseSpec.parse(case_id))
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    blocked = run_virtual(CaseSpec.parse(case_id))
    assert [repr(r) for r in blocked] == [repr(r) for r in whole]


def test_the_blocked_comparison_counts_what_differs(monkeypatch):
    from qgather.scenarios.virtual import run_virtual

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    stage = run_virtual(CaseSpec.parse("mutant:nibble_swap:nvfp4_2d:512x64:bf16:ws2:gather:s0"))[0].stages[0]
    assert stage.dequantized.n_diff > 0 and not stage.dequantized.equal



@pytest.mark.parametrize("yielded", [3, 5])
def test_an_adapter_yielding_another_number_of_blocks_is_named(yielded, monkeypatch):
    """A case whose implementation dequantizes into too few or too many row blocks ERRORs with the
    counts, rather than comparing some rows twice or not at all."""
    from qgather.impls.reference import ReferenceImplementation
    from qgather.scenarios.virtual import run_virtual

    def wrong_count(self, param, fmt, blocks):
        start, stop = blocks[0]
        return (torch.zeros(stop - start, param.shape[-1]) for _ in range(yielded))

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(ReferenceImplementation, "own_dequantize_blocks", wrong_count)
    results = run_virtual(CaseSpec.parse("reference:fp8_tensor:512x64:bf16:ws2:gather:s0"))
    assert all(isinstance(r, Exception) for r in results)
    assert "own_dequantize_blocks yielded" in str(results[0]) and "4 row blocks" in str(results[0])


class _RowsOnly:
    """An adapter whose layer output comes only block by block (`forward_rows`), from `q`'s values."""

    name = "rows-only"

    def __init__(self, fmt, q, corrupt_block: int | None = None):
        self.fmt, self.q, self.corrupt_block, self.calls = fmt, q, corrupt_block, []

    def forward(self, param, x):
        raise AssertionError("a weight the adapter can cut by rows was multiplied whole")

    def forward_rows(self, param, x, start, stop):
        self.calls.append((start, stop))
        values = self.fmt.dequantize_rows(self.q, start, stop).to(x.dtype)
        if len(self.calls) - 1 == self.corrupt_block:
            values[0, 0] += 1
        return torch.matmul(x, values.transpose(-1, -2))

    def output_tolerance(self, fmt):
        return None


@pytest.mark.parametrize("corrupt", [None, 1])
def test_a_large_output_is_checked_block_by_block_on_both_sides(corrupt, monkeypatch):
    from qgather.check.golden import golden_for
    from qgather.check.inspection import Inspector
    from qgather.model.case import shard_layout

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    fmt, weight = FORMATS["nvfp4_2d"], _weight((448, 64))
    golden = golden_for(fmt, weight)
    spec = CaseSpec.parse("reference:nvfp4_2d:448x64:bf16:ws2:gather:s0")
    impl = _RowsOnly(fmt, golden.q, corrupt)
    x = torch.randn(4, 64).to(torch.bfloat16)
    inspector = Inspector(spec, impl, fmt, x, shard_layout(spec))
    output, _, error = inspector._forward(weight, golden)
    assert error == ""
    assert impl.calls == [tuple(b) for b in fmt.row_blocks((448, 64))] and len(impl.calls) > 1
    assert output.equal is (corrupt is None)
    if corrupt is not None:
        assert output.n_diff > 0


class _RowsAndOwn(_RowsOnly):
    """`_RowsOnly` with buffers (the golden's own) and a dequantization of its own, block by block."""

    def is_quantized(self, param):
        return True

    def read_buffers(self, param):
        return dict(self.q.buffers)

    def own_dequantize_blocks(self, param, fmt, blocks):
        return (fmt.dequantize_rows(self.q, start, stop) for start, stop in blocks)


@pytest.mark.parametrize("corrupt", [None, 1])
def test_a_kept_golden_is_dequantized_once_per_judge_after_the_first(corrupt, monkeypatch):
    """The first judge of a golden compares the library's blocks with the golden's blocks handed over
    deferred, then computes the golden layer's output on its own pass (one block made at a time:
    no golden values next to the library's); a later judge with the same input reads the kept
    output: one pass, the same stage. The output's comparison is the one computed on its own."""
    from qgather.check.golden import Golden, golden_for
    from qgather.check.inspection import Inspector
    from qgather.model.case import shard_layout

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    fmt, weight = FORMATS["nvfp4_2d"], _weight((448, 64))
    golden = golden_for(fmt, weight)
    spec = CaseSpec.parse("reference:nvfp4_2d:448x64:bf16:ws2:gather:s0")
    x = torch.randn(4, 64).to(torch.bfloat16)
    passes, blocks_of = [], Golden.dequantized_blocks
    monkeypatch.setattr(Golden, "dequantized_blocks",
                        lambda self, deferred=False: passes.append(deferred) or blocks_of(self, deferred))
    def judge():  # a fresh adapter each time: it corrupts the n-th block it is asked for
        inspector = Inspector(spec, _RowsAndOwn(fmt, golden.q, corrupt), fmt, x, shard_layout(spec))
        return inspector.judge(weight.to(torch.bfloat16), golden, "unshard 1")

    stage = judge()
    assert passes == [True, False] and stage.own_dequantized.equal and stage.forward_error == ""
    passes.clear()
    assert judge() == stage and passes == [True]
    alone, _, _ = Inspector(spec, _RowsOnly(fmt, golden.q, corrupt), fmt, x, shard_layout(spec))._forward(
        weight.to(torch.bfloat16), golden_for(fmt, weight))
    assert stage.output == alone and stage.output.equal is (corrupt is None)
