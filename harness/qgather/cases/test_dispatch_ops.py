"""The ops FSDP2 applies to a parameter, one by one, on each implementation's quantized weight.

A handler that ignores slice bounds, an as_strided offset or a view's shape (bug class 3), or
that silently falls back to high precision (bug class 11), shows up here without any collective:
each op's result must stay quantized and equal the same op applied to the dequantized weight -
or raise. Implementations that expose no standalone parameter are skipped.
"""

import pytest
import torch

from qgather.formats import FORMATS
from qgather.impls import get_impl
from qgather.model.case import CaseSpec

K = 64


def pytest_generate_tests(metafunc):
    # deferred: `qgather list --cases` imports this module for its SWEEP alone, without the plugin
    from qgather.pytest_plugin.options import settings

    if "impl_fmt" in metafunc.fixturenames:
        # each implementation's declared formats only (an adapter's others are no test of it)
        params = [(i, f) for i in settings(metafunc.config).impls for f in FORMATS if f in get_impl(i).formats]
        metafunc.parametrize("impl_fmt", params, ids=[f"{i}:{f}" for i, f in params])


@pytest.fixture
def quantized(impl_fmt):
    impl_name, fmt_name = impl_fmt
    impl, fmt = get_impl(impl_name), FORMATS[fmt_name]
    spec = CaseSpec(impl_name, fmt_name, (4 * fmt.row_block, K), "bf16", 1, "hooks")
    reason = impl.skip_reason(spec, torch.device("cpu"))
    if reason:
        pytest.skip(reason)
    weight = (torch.randn(spec.shape, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    param = impl.make_param(fmt_name, weight)
    if param is None:
        pytest.skip(f"{impl_name} exposes no standalone quantized parameter")
    dequantized = param.float().clone()  # own storage: as_strided below addresses storage offsets
    return impl, fmt, param, dequantized


def _same(impl, result, expected):
    assert impl.is_quantized(result), f"the op returned a {type(result).__name__}, not the quantized type"
    assert tuple(result.shape) == tuple(expected.shape)
    assert torch.equal(result.float(), expected), "the op's result does not hold the rows it should"


def test_chunk(quantized):
    impl, fmt, param, deq = quantized
    for piece, want in zip(torch.chunk(param, 2), torch.chunk(deq, 2)):
        _same(impl, piece, want)


def test_slice_and_narrow(quantized):
    impl, fmt, param, deq = quantized
    b = fmt.row_block
    _same(impl, param[b : 3 * b], deq[b : 3 * b])
    _same(impl, param.narrow(0, 2 * b, b), deq.narrow(0, 2 * b, b))


def test_as_strided_with_offset(quantized):
    impl, fmt, param, deq = quantized
    b = fmt.row_block
    _same(impl, torch.as_strided(param, (b, K), (K, 1), b * K), torch.as_strided(deq, (b, K), (K, 1), b * K))


def test_view_and_detach(quantized):
    impl, _, param, deq = quantized
    _same(impl, param.view(param.shape), deq)
    _same(impl, param.detach(), deq)


def test_new_zeros_then_copy(quantized):
    impl, fmt, param, deq = quantized
    b = fmt.row_block
    padded = param.new_zeros((2 * b, K))
    assert impl.is_quantized(padded) and torch.equal(padded.float(), torch.zeros(2 * b, K))
    padded.narrow(0, 0, b).copy_(param[:b])
    expected = torch.zeros(2 * b, K)
    expected[:b] = deq[:b]
    _same(impl, padded, expected)


def test_strided_slice_is_exact_or_refused(quantized):
    impl, _, param, deq = quantized
    try:
        result = param[::2]
    except (NotImplementedError, ValueError, RuntimeError):
        return  # refusing is fine; ignoring the step silently is not
    _same(impl, result, deq[::2])
