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
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
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
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    assert fmt.quantize(weight, amax=amax).mismatches(whole) == []


def test_blocks_start_on_whole_scale_blocks(monkeypatch):
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", 1000)
    for fmt in FORMATS.values():
        starts = [start for start, _ in fmt.row_blocks((1024, 16))]
        assert all(start % fmt.row_block_multiple == 0 for start in starts), fmt.name
        assert fmt.row_blocks((1024, 16))[-1][1] == 1024


def test_a_block_that_splits_a_scale_block_is_refused(monkeypatch):
    fmt = FORMATS["fp8_block"]
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
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


@pytest.mark.parametrize("check_blocks", [1, 2, 1 << 20], ids=["check=quantize", "check=2x", "one-check-block"])
@pytest.mark.parametrize("case_id", BLOCKED_CASES)
def test_a_case_judged_in_row_blocks_gets_the_same_records(case_id, check_blocks, monkeypatch):
    """Every comparison of a case (values, dequantized weight, outputs, the map of differing rows)
    is the same whether the golden is dequantized whole or in row blocks, the check's blocks as
    large as the quantization's, larger, or one block holding a tensor quantized in several."""
    from qgather.scenarios.virtual import run_virtual

    whole = run_virtual(CaseSpec.parse(case_id))
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS * check_blocks)
    shape = CaseSpec.parse(case_id).shape
    fmt = FORMATS[CaseSpec.parse(case_id).fmt]
    assert not fmt.judged_whole(shape) and len(fmt.row_blocks(shape)) > 1
    assert (len(fmt.check_blocks(shape)) == 1) is (check_blocks == 1 << 20)
    blocked = run_virtual(CaseSpec.parse(case_id))
    assert [repr(r) for r in blocked] == [repr(r) for r in whole]


def test_the_blocked_comparison_counts_what_differs(monkeypatch):
    from qgather.scenarios.virtual import run_virtual

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
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
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(ReferenceImplementation, "own_dequantize_blocks", wrong_count)
    results = run_virtual(CaseSpec.parse("reference:fp8_tensor:512x64:bf16:ws2:gather:s0"))
    assert all(isinstance(r, Exception) for r in results)
    assert "own_dequantize_blocks yielded" in str(results[0]) and "4 row blocks" in str(results[0])


def _nvfp4_case_in_small_blocks(monkeypatch):
    """(format, weight, golden, case, layer input) of a 448x64 NVFP4 case, its row blocks small
    enough to cut it in several."""
    from qgather.check.golden import golden_for

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    fmt, weight = FORMATS["nvfp4_2d"], _weight((448, 64))
    spec = CaseSpec.parse("reference:nvfp4_2d:448x64:bf16:ws2:gather:s0")
    return fmt, weight, golden_for(fmt, weight), spec, torch.randn(4, 64).to(torch.bfloat16)


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

    def forward_own_rows(self, x, own_rows):
        return None  # as Implementation's: its forward is not its own dequantization multiplied


@pytest.mark.parametrize("corrupt", [None, 1])
def test_a_large_output_is_checked_block_by_block_on_both_sides(corrupt, monkeypatch):
    from qgather.check.golden import golden_for
    from qgather.check.inspection import Inspector
    from qgather.model.case import shard_layout

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
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

    fmt, weight, golden, spec, x = _nvfp4_case_in_small_blocks(monkeypatch)
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


class _OwnRowsForward(_RowsAndOwn):
    """`_RowsAndOwn` whose layer output multiplies its own dequantization (`forward_own_rows`): the
    inspection then takes the output from the value check's blocks; `forward_rows` must not run."""

    def __init__(self, fmt, q, corrupt_block=None, raise_in_forward=False):
        super().__init__(fmt, q, corrupt_block)
        self.own_passes, self.raise_in_forward = 0, raise_in_forward

    def own_dequantize_blocks(self, param, fmt, blocks):
        self.own_passes += 1
        for index, (start, stop) in enumerate(blocks):
            values = fmt.dequantize_rows(self.q, start, stop)
            if index == self.corrupt_block:
                values[0, 0] += 1
            yield values

    def forward_rows(self, param, x, start, stop):
        raise AssertionError("the output was not taken from the value check's blocks")

    def forward_own_rows(self, x, own_rows):
        if self.raise_in_forward:
            raise RuntimeError("GEMM refused the block")
        return torch.matmul(x, own_rows.to(x.dtype).transpose(-1, -2))


@pytest.mark.parametrize("corrupt", [None, 1])
def test_the_output_comes_from_the_value_checks_own_blocks(corrupt, monkeypatch):
    """An adapter whose forward multiplies its own dequantization is dequantized once per judge
    (both checks read the same blocks): the output's comparison is the one `forward_rows` would have
    given, a corrupted block shows in the value check and in the output, and a forward that raises
    is the stage's forward error next to the value check."""
    from qgather.check.golden import golden_for
    from qgather.check.inspection import Inspector
    from qgather.model.case import shard_layout

    fmt, weight, golden, spec, x = _nvfp4_case_in_small_blocks(monkeypatch)
    impl = _OwnRowsForward(fmt, golden.q, corrupt)
    stage = Inspector(spec, impl, fmt, x, shard_layout(spec)).judge(weight.to(torch.bfloat16), golden, "unshard 1")
    assert impl.own_passes == (1 if corrupt is None else 2)  # again only to size a difference
    alone, _, _ = Inspector(spec, _RowsOnly(fmt, golden.q, corrupt), fmt, x, shard_layout(spec))._forward(
        weight.to(torch.bfloat16), golden_for(fmt, weight))
    assert stage.output == alone and stage.forward_error == ""
    assert stage.own_dequantized.equal is stage.output.equal is (corrupt is None)
    raising = _OwnRowsForward(fmt, golden.q, raise_in_forward=True)
    failed = Inspector(spec, raising, fmt, x, shard_layout(spec)).judge(weight.to(torch.bfloat16), golden, "unshard 1")
    assert failed.forward_error == "RuntimeError: GEMM refused the block" and failed.output is None
    assert failed.own_dequantized.equal


def test_one_block_of_the_librarys_values_is_held_at_a_time(monkeypatch):
    """While the library makes its next own block, no earlier block is still referenced by the
    inspection (the value check, the output columns, the pairing with the golden): a large weight's
    check holds one block of float32 values, not two."""
    import weakref

    from qgather.check.golden import golden_for
    from qgather.check.inspection import Inspector
    from qgather.model.case import shard_layout

    class Watched(_OwnRowsForward):
        def own_dequantize_blocks(self, param, fmt, blocks):
            self.made, self.alive_when_making = [], []
            for start, stop in blocks:
                self.alive_when_making.append(sum(ref() is not None for ref in self.made))
                values = fmt.dequantize_rows(self.q, start, stop)
                self.made.append(weakref.ref(values))
                yield values
                del values

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    fmt, weight = FORMATS["fp8_block"], _weight((1024, 64))
    golden = golden_for(fmt, weight)
    spec = CaseSpec.parse("reference:fp8_block:1024x64:bf16:ws2:gather:s0")
    impl = Watched(fmt, golden.q)
    x = torch.randn(4, 64).to(torch.bfloat16)
    stage = Inspector(spec, impl, fmt, x, shard_layout(spec)).judge(weight.to(torch.bfloat16), golden, "unshard 1")
    assert stage.own_dequantized.equal and stage.output.equal
    assert len(impl.alive_when_making) == len(fmt.check_blocks((1024, 64))) > 2
    assert impl.alive_when_making == [0] * len(impl.alive_when_making)


@pytest.mark.parametrize("kept", [False, True])
def test_an_inspection_reads_the_device_once(kept, monkeypatch):
    """Every check of an inspection (the library's own blocks, the layer output, the buffers) is
    launched before any count is read: one read of the device per judge, whether the golden layer's
    output is computed or kept; the stage is the one of checks read one by one."""
    from qgather.check.inspection import Inspector
    from qgather.instruments import compare
    from qgather.model.case import shard_layout

    fmt, weight, golden, spec, x = _nvfp4_case_in_small_blocks(monkeypatch)
    inspector = Inspector(spec, _OwnRowsForward(fmt, golden.q), fmt, x, shard_layout(spec))
    if kept:
        inspector.judge(weight.to(torch.bfloat16), golden, "unshard 1")
    reads, to_host = [], compare._to_host
    monkeypatch.setattr(compare, "_to_host", lambda counts: reads.append(len(counts)) or to_host(counts))
    stage = inspector.judge(weight.to(torch.bfloat16), golden, "unshard 1")
    n_blocks, n_buffers = len(fmt.check_blocks(golden.q.shape)), len(golden.q.buffers)
    assert reads == [n_buffers + n_blocks + 1 + kept]  # + the output's count, + the kept input's
    assert stage.own_dequantized.equal and stage.output.equal and stage.buffer_diffs == ()


def test_a_kept_output_serves_only_the_input_it_was_computed_for(monkeypatch):
    """The golden keeps its layer output for the last input; an inspection with another input of
    the same shape compares with the golden layer's output for that input (computed, then kept)."""
    from qgather.check.golden import golden_for
    from qgather.check.inspection import Inspector
    from qgather.model.case import shard_layout

    fmt, weight, golden, spec, x = _nvfp4_case_in_small_blocks(monkeypatch)
    other = x.clone()
    other[1, 2] += 1
    judged = {}
    for name, layer_input in (("x", x), ("other", other), ("other again", other)):
        inspector = Inspector(spec, _OwnRowsForward(fmt, golden.q), fmt, layer_input, shard_layout(spec))
        judged[name] = inspector.judge(weight.to(torch.bfloat16), golden, "unshard 1")
        assert judged[name].output.equal
    fresh = Inspector(spec, _OwnRowsForward(fmt, golden.q), fmt, other, shard_layout(spec))
    assert judged["other"] == judged["other again"] == fresh.judge(weight.to(torch.bfloat16),
                                                                   golden_for(fmt, weight), "unshard 1")
    assert judged["other"].output_digest != judged["x"].output_digest


def test_a_golden_makes_its_deferred_blocks_once_while_its_buffers_stay(monkeypatch):
    """The deferred golden blocks (views of its buffers) are made once and serve every later
    inspection; a replaced buffer lets them go: the blocks then read the new buffer."""
    fmt, weight, golden, _, _ = _nvfp4_case_in_small_blocks(monkeypatch)
    made, parts_of = [], type(fmt).dequantize_rows_parts
    monkeypatch.setattr(type(fmt), "dequantize_rows_parts",
                        lambda self, q, start, stop: made.append(start) or parts_of(self, q, start, stop))

    def values():
        return torch.cat([want.values() for _, want in golden.dequantized_blocks(deferred=True)])

    first = values()
    n_blocks = len(fmt.check_blocks(golden.q.shape))
    assert n_blocks > 1 and len(made) == n_blocks and torch.equal(values(), first) and len(made) == n_blocks
    golden.replace_buffers({"amax_rowwise": golden.q.buffers["amax_rowwise"] * 2})
    assert torch.equal(values(), first * 2) and len(made) == 2 * n_blocks


def test_the_golden_layer_is_in_the_weights_dtype_whatever_the_outputs():
    """An adapter whose layer returns its output in another dtype than the weight's (here float32 from
    a bfloat16 weight) is compared with the golden layer computed in the weight's dtype, as the layer
    computes it: equal, and digested as its own output (not the golden's, of another dtype)."""
    from qgather.check.golden import golden_for
    from qgather.check.inspection import Inspector
    from qgather.impls import get_impl
    from qgather.model.case import shard_layout

    class FloatOutput(type(get_impl("reference"))):
        def forward(self, param, x):
            return super().forward(param, x).float()

    fmt, weight = FORMATS["fp8_tensor"], _weight((64, 32))
    golden = golden_for(fmt, weight)
    spec = CaseSpec.parse("reference:fp8_tensor:64x32:bf16:ws2:gather:s0")
    inspector = Inspector(spec, FloatOutput(), fmt, torch.randn(4, 32).to(torch.bfloat16), shard_layout(spec))
    output, output_digest, error = inspector._forward(golden.dequantized_as(torch.bfloat16), golden)
    assert error == "" and output.equal and output_digest != golden.output_digest()
