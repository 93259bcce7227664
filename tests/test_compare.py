"""The comparison primitives: bitwise value comparison, digests and their device-side fingerprint."""

import hashlib

import pytest
import torch

from qgather.instruments.compare import compare_values
from qgather.instruments.digest import _fingerprint, digest, tensor_bytes
from qgather.model.case import CaseSpec
from qgather.scenarios.data import make_weight, row_scales


def test_fingerprint_sees_one_changed_word_and_swapped_rows():
    a = torch.randn(300, 1000, generator=torch.Generator().manual_seed(0))
    changed, swapped = a.clone(), a.clone()
    changed[123, 45] = torch.nextafter(changed[123, 45], torch.tensor(float("inf")))
    swapped[[0, 1]] = swapped[[1, 0]]
    assert _fingerprint(a) == _fingerprint(a.clone())
    assert _fingerprint(changed) != _fingerprint(a)
    assert _fingerprint(swapped) != _fingerprint(a)


def test_fingerprint_covers_a_trailing_partial_word_and_the_length():
    a = torch.arange(4097, dtype=torch.uint8)
    b = a.clone()
    b[-1] += 1
    assert _fingerprint(a) != _fingerprint(b)
    assert _fingerprint(torch.zeros(8, dtype=torch.uint8)) != _fingerprint(torch.zeros(12, dtype=torch.uint8))


def test_cpu_digest_hashes_the_bytes_themselves():
    t = torch.randn(2048, 1024)  # 8 MiB: above the fingerprint threshold, but on the CPU
    expected = hashlib.sha256(f"w:{tuple(t.shape)}:{t.dtype};".encode() + tensor_bytes(t)).hexdigest()
    assert digest({"w": t}, {}) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compare_values_is_bitwise(dtype):
    want = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=dtype)
    assert compare_values(want.clone(), want).equal  # NaN == NaN bit for bit
    got = want.clone()
    got[0] = -0.0
    got[3] = 2.5
    result = compare_values(got, want)
    assert not result.equal and result.n_diff == 2 and result.max_abs == 0.5


def test_compare_values_across_dtypes_compares_float32_values():
    want = torch.tensor([1.0, 3.0])
    assert compare_values(want.to(torch.bfloat16), want).equal
    assert not compare_values(torch.tensor([1.0, 3.015625], dtype=torch.bfloat16), want).equal


def test_small_and_cpu_weights_come_from_the_cpu_generator():
    spec = CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s3")
    expected = torch.randn(spec.shape, generator=torch.Generator().manual_seed(3)) * row_scales(spec)
    assert torch.equal(make_weight(spec), expected)
    assert torch.equal(make_weight(spec, "cpu"), expected)


def test_differences_are_counted_in_blocks_of_rows(monkeypatch):
    from qgather.formats import QuantizedTensor
    from qgather.instruments import compare

    want = torch.arange(64 * 48, dtype=torch.int32).reshape(64, 48).to(torch.uint8)
    have = want.clone()
    have[3, 5] ^= 1
    have[40:42, :] ^= 2  # rows that straddle a block boundary below
    golden = QuantizedTensor("x", (64, 48), {"data": want}, {"data": (slice(0, 64), slice(0, 48))})
    monkeypatch.setattr(compare, "_DEVICE_CHUNK", 48 * 5)  # blocks of 5 rows
    (diff,) = compare.compare_buffers({"data": have}, golden)
    assert (diff.n_diff, diff.n_valid) == (1 + 2 * 48, 64 * 48)


def test_buffer_differences_are_records_rendered_only_as_lines():
    from qgather.formats import QuantizedTensor
    from qgather.instruments.compare import compare_buffers
    from qgather.model.records import BufferDiff, DiffProblem

    want = {"data": torch.zeros(4, 8, dtype=torch.uint8), "scale": torch.ones(4, 1), "amax": torch.ones(1)}
    golden = QuantizedTensor("fp8_tensor", (4, 8), want, {name: (slice(None),) * t.dim() for name, t in want.items()})
    got = {"data": want["data"].clone(), "scale": torch.ones(2, 1)}
    got["data"][1, 3] = 7
    diffs = compare_buffers(got, golden)
    assert diffs == [BufferDiff("data", DiffProblem.BITS, n_diff=1, n_valid=32),
                     BufferDiff("scale", DiffProblem.SHAPE, detail="(2, 1) != golden (4, 1)"),
                     BufferDiff("amax", DiffProblem.MISSING, detail="(the implementation has no such buffer)")]
    assert [d.line() for d in diffs] == ["data: 1 of 32 valid elements differ", "scale: shape (2, 1) != golden (4, 1)",
                                         "amax: missing (the implementation has no such buffer)"]
    assert [d.problem.breaks_layout for d in diffs] == [False, True, True]
    assert BufferDiff("w.data", DiffProblem.BITS, n_diff=3).line() == "w.data: 3 bytes differ"
    assert BufferDiff("w", DiffProblem.HELD_ONLY, detail="on one GPU").line() == "w: held only on one GPU"
    assert BufferDiff("w", DiffProblem.VALUES, n_diff=2, max_abs=0.5).line() == \
        "w: 2 dequantized values differ, max |diff| 0.5"


def _q(buffers):
    from qgather.formats import QuantizedTensor
    return QuantizedTensor("fp8_block", (64, 64), buffers, {n: tuple(slice(None) for _ in t.shape)
                                                            for n, t in buffers.items()})


@pytest.mark.parametrize("numel", [4096, 4095, 4094, 4093])  # read as 8-, 1-, 2- and 1-byte words
def test_word_compare_counts_every_differing_element_not_word(numel):
    from qgather.instruments.compare import compare_buffers
    want = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = want.clone()
    got[[8, 9, 10, numel - 1]] ^= 1  # three bytes of one 8-byte word, and the last byte
    assert compare_buffers({"d": want.clone()}, _q({"d": want})) == []
    (diff,) = compare_buffers({"d": got}, _q({"d": want}))
    assert (diff.name, diff.n_diff, diff.n_valid) == ("d", 4, numel)


@pytest.mark.parametrize("chunk", [1 << 26, 3, 1])  # one pass, or a running total over chunks of words
def test_every_chunk_of_words_is_compared(monkeypatch, chunk):
    from qgather.instruments import compare
    monkeypatch.setattr(compare, "_WORD_CHUNK", chunk)
    want = torch.randint(0, 256, (80,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert compare.compare_buffers({"d": want.clone()}, _q({"d": want})) == []
    for flipped in (0, 41, 79):  # the first, a middle and the last 8-byte word
        got = want.clone()
        got[flipped] ^= 4
        (diff,) = compare.compare_buffers({"d": got}, _q({"d": want}))
        assert (diff.n_diff, diff.n_valid) == (1, 80)


def test_a_transposed_view_of_a_golden_buffer_compares_as_its_contiguous_copy():
    from qgather.instruments.compare import compare_buffers
    rowwise = torch.randint(0, 256, (96, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    got = rowwise.t().contiguous()
    assert compare_buffers({"c": got}, _q({"c": rowwise.t()})) == []
    got[3, 7] ^= 0x80
    (diff,) = compare_buffers({"c": got}, _q({"c": rowwise.t()}))
    assert (diff.n_diff, diff.n_valid) == (1, 96 * 40)


def test_value_blocks_are_made_again_only_to_size_a_difference():
    from qgather.instruments.compare import compare_value_blocks
    want = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    made = []

    def pairs(got):
        made.append(True)
        return zip(got, want)

    same = compare_value_blocks(lambda: pairs([w.clone() for w in want]))
    assert (same.equal, same.n_diff, len(made)) == (True, 0, 1)
    made.clear()
    got = [w.clone() for w in want]
    got[2][1, 3] += 0.5
    got[0][0, 0] = float("nan")
    differ = compare_value_blocks(lambda: pairs(got))
    assert (differ.equal, differ.n_diff, differ.max_abs, len(made)) == (False, 2, float("inf"), 2)
    shape = compare_value_blocks(lambda: zip([torch.zeros(4, 7)], want))
    assert (shape.equal, shape.n_diff) == (False, -1)


@pytest.mark.parametrize("fmt_name", ["fp8_block", "nvfp4_2d", "nvfp4_1d"])
def test_a_goldens_deferred_row_blocks_are_its_dequantized_rows(fmt_name, monkeypatch):
    from qgather.check.golden import golden_for
    from qgather.formats import FORMATS, base
    from qgather.instruments.compare import Deferred, compare_value_blocks

    monkeypatch.setattr(base, "ROW_BLOCK_ELEMENTS", 1 << 15)  # row blocks of a small weight
    monkeypatch.setattr(base, "CHECK_BLOCK_ELEMENTS", 1 << 15)
    spec = CaseSpec.parse(f"reference:{fmt_name}:512x256:bf16:ws2:gather:s0")
    golden = golden_for(FORMATS[fmt_name], make_weight(spec))
    deferred = list(golden.dequantized_blocks(deferred=True))
    made = list(golden.dequantized_blocks())
    assert len(made) > 1 and all(isinstance(want, Deferred) for _, want in deferred)
    for (rows, want), (same_rows, values) in zip(deferred, made, strict=True):
        assert rows == same_rows and torch.equal(want.values().view(torch.int32), values.view(torch.int32))
    got = [values.clone() for _, values in made]
    assert compare_value_blocks(lambda: zip(got, (w for _, w in deferred))).equal
    got[-1][3, 4] = -got[-1][3, 4] if got[-1][3, 4] else 1.0
    changed = compare_value_blocks(lambda: zip(got, (w for _, w in deferred)))
    assert (changed.equal, changed.n_diff) == (False, 1)


@pytest.mark.parametrize("shape", [(96, 64), (100, 64)])  # in 32 x 32 tiles, and not
def test_the_tiled_count_is_the_plain_count(shape):
    from qgather.instruments.fused import _count_mask

    rowwise = torch.randint(0, 4, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    got = torch.randint(0, 4, (shape[1], shape[0]), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    assert int(_count_mask(got, rowwise.t())) == int((got != rowwise.t()).sum())


def test_a_compiled_comparison_past_the_recompile_limit_compares_eagerly_and_keeps_the_compiler(monkeypatch):
    """torch.compile's recompile limit (a function compiled for too many shapes) sends that one call
    to the eager comparison; any other compiler failure marks the compiler as unusable here."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from qgather.instruments import fused

    monkeypatch.setattr(fused, "_BROKEN", [])

    def raising(exc):
        def compiled():
            def call(*tensors):
                raise exc
            return call
        return compiled

    assert fused._run(raising(FailOnRecompileLimitHit("limit")), torch.zeros(1)) is None
    assert fused._BROKEN == []
    with pytest.warns(RuntimeWarning, match="cannot run here"):
        assert fused._run(raising(RuntimeError("no C compiler")), torch.zeros(1)) is None
    assert fused._BROKEN == ["RuntimeError: no C compiler"]
