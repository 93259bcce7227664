"""The compiled comparisons on a GPU (qgather.instruments.fused: a golden's transposed view, a
golden's row blocks never made) count exactly what the eager comparison counts, and they really ran.

    python -m pytest tests/gpu/test_fused_compare.py -q -p no:cacheprovider -m gpu
"""

from __future__ import annotations

import pytest
import torch

from qgather.formats import FORMATS
from qgather.instruments import compare, fused, kernels

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("route", ("triton", "compiled"))
@pytest.mark.parametrize("shape", ((3000, 2048), (4096, 2048), (4100, 2050)))  # whole tiles or not
@pytest.mark.parametrize("dtype", (torch.uint8, torch.int32))
@pytest.mark.parametrize("n_diff", (0, 1, 977))
def test_the_compiled_count_of_a_transposed_view_is_the_eager_count(cuda, route, shape, dtype, n_diff, monkeypatch):
    """Both routes of a transposed pair: the Triton kernel (count_by_triton) and, where Triton
    could not run, the compiled tiled reduction."""
    generator = torch.Generator(device=cuda).manual_seed(n_diff)
    rowwise = torch.randint(0, 120, shape, dtype=dtype, device=cuda, generator=generator)
    got = rowwise.t().contiguous()
    flat = got.view(-1)
    where = torch.randperm(flat.numel(), device=cuda, generator=generator)[:n_diff]
    flat[where] += 1
    view = rowwise.t()
    assert fused.large_pair(got, view) and not view.is_contiguous()
    if route == "compiled":
        monkeypatch.setattr(fused, "count_by_triton", lambda a, b: None)
    else:
        assert fused.count_by_triton(got, view) is not None, "Triton did not run: nothing tested"
    compiled = int(compare._count_differing(got, view))
    eager = int(sum((got[i:i + 256] != view[i:i + 256]).sum() for i in range(0, got.shape[0], 256)))
    assert compiled == eager == n_diff
    assert not fused._BROKEN and not kernels.TRITON_BROKEN  # the kernels ran, not a fallback


@pytest.mark.parametrize("route", ("triton", "compiled"))
@pytest.mark.parametrize("nbytes", (1 << 25, (1 << 25) + 6, (1 << 25) + 4099))  # 8-, 2-, 1-byte words
@pytest.mark.parametrize("n_diff", (0, 1, 977))
def test_the_compiled_count_of_two_buffers_is_the_eager_count(cuda, route, nbytes, n_diff, monkeypatch):
    generator = torch.Generator(device=cuda).manual_seed(n_diff)
    want = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=cuda, generator=generator)
    got = want.clone()
    words = compare._widest(got)
    assert fused.large_pair(words, compare._widest(want))
    width = words.element_size()
    where = torch.randperm(words.numel(), device=cuda, generator=generator)[:n_diff] * width  # one byte a word
    got[where] ^= 0x10
    if route == "compiled":
        monkeypatch.setattr(fused, "count_by_triton", lambda a, b: None)
    else:
        assert fused.count_by_triton(words, compare._widest(want)) is not None, "Triton did not run"
    compiled = int(compare._differing_words(got, want))
    eager = int((got != want).sum())
    assert compiled == eager == n_diff
    assert not fused._BROKEN and not kernels.TRITON_BROKEN  # the kernels ran, not a fallback


def test_a_kept_fp8_block_golden_judges_a_broken_columnwise_copy(cuda):
    from qgather.check.golden import golden_for
    from qgather.formats import QuantizedTensor

    fmt = FORMATS["fp8_block"]
    golden = golden_for(fmt, torch.randn(2048, 4096, device=cuda))
    golden.keep_on_device()
    got = {name: t.contiguous().clone() for name, t in golden.q.buffers.items()}
    got["columnwise_data"][17, 1031] ^= 0x40
    diffs = compare.compare_buffers(got, QuantizedTensor(fmt.name, golden.q.shape, golden.q.buffers, golden.q.valid))
    assert [(d.name, d.n_diff) for d in diffs] == [("columnwise_data", 1)]


@pytest.mark.parametrize("route", ("triton", "compiled"))
@pytest.mark.parametrize("fmt_name", ("fp8_block", "nvfp4_2d", "nvfp4_1d"))
@pytest.mark.parametrize("shape", ((4096, 8192), (4000, 8208)))  # whole tiles and programs or not
@pytest.mark.parametrize("n_diff", (0, 1, 513))
def test_a_compiled_golden_block_comparison_counts_what_the_made_values_count(cuda, route, fmt_name, shape, n_diff,
                                                                              monkeypatch):
    """The golden's row blocks dequantized inside the comparison (never made), by the format's
    Triton kernel (qgather.instruments.fused_values) or, where it cannot run, the compiled one, against
    the same blocks made and compared eagerly, with differences planted (one ulp)."""
    from qgather.check.golden import golden_for
    from qgather.formats import base as format_base
    from qgather.instruments import fused_values
    from qgather.instruments.compare import Deferred, compare_value_blocks

    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", 1 << 24)  # two check blocks of this golden
    launched = []
    if route == "compiled":
        monkeypatch.setattr(fused_values, "count", lambda got, fn, tensors: None)
    else:
        real = fused_values.count
        monkeypatch.setattr(fused_values, "count", lambda *a: launched.append(real(*a)) or launched[-1])
    generator = torch.Generator(device=cuda).manual_seed(n_diff)
    scales = torch.logspace(-3, 3, shape[0], device=cuda).reshape(-1, 1)  # row blocks of very different scales
    golden = golden_for(FORMATS[fmt_name], torch.randn(shape, device=cuda, generator=generator) * scales)
    made = [values.clone() for _, values in golden.dequantized_blocks()]
    deferred = [want for _, want in golden.dequantized_blocks(deferred=True)]
    assert len(made) > 1 and all(isinstance(want, Deferred) for want in deferred)
    got = [values.clone() for values in made]
    flat = got[-1].view(-1)
    where = torch.randperm(flat.numel(), device=cuda, generator=generator)[:n_diff]
    flat.view(torch.int32)[where] ^= 1  # the last mantissa bit: one ulp
    compiled = compare_value_blocks(lambda: zip(got, deferred))
    eager = compare_value_blocks(lambda: zip(got, made))
    assert (compiled.equal, compiled.n_diff, compiled.max_abs) == (eager.equal, eager.n_diff, eager.max_abs)
    assert compiled.n_diff == n_diff
    assert not fused._BROKEN and not kernels.TRITON_BROKEN  # the comparison ran, not a fallback
    if route == "triton":  # every block large enough for a kernel (the last may be short) went to Triton's
        large = sum(want.shape.numel() >= fused.FUSED_MIN_ELEMENTS for want in deferred)
        assert large and len(launched) == large and all(c is not None for c in launched), "Triton did not run"


def test_the_e2m1_pair_table_is_built_alike_on_the_gpu(cuda):
    from qgather.formats import numerics as nx

    like = torch.empty(0, dtype=torch.uint8, device=cuda)
    on_gpu = nx.e2m1_pair_table(like)
    assert nx.e2m1_pair_table(like) is on_gpu  # kept for plain tensors on a GPU
    on_cpu = nx.e2m1_pair_table(like.cpu())
    assert torch.equal(on_gpu.cpu().view(torch.int32), on_cpu.view(torch.int32))
