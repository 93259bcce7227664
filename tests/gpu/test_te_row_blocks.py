"""TE's own dequantization of a large gathered weight runs block of rows by block
(qgather.impls.te.tensors.row_slice): each block must be bit for bit the same rows of TE's whole
dequantization, for every TE tensor class this GPU can build, with a partial last block.

    python -m pytest tests/gpu/test_te_row_blocks.py -q -p no:cacheprovider -m gpu
"""

from __future__ import annotations

import pytest
import torch

from qgather.formats import FORMATS
from qgather.formats import base as format_base

pytestmark = pytest.mark.gpu

SHAPE = (1000, 256)  # 1000 rows: blocks of 256 rows and a partial last one
FORMAT_NAMES = ("fp8_tensor", "fp8_block", "fp8_block_1x128", "mxfp8", "nvfp4_2d", "nvfp4_1d")


@pytest.fixture(scope="module")
def te_ready():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qgather.impls.te.environment import te_import_error

    error = te_import_error()
    if error:
        pytest.skip(error)


def _te_tensor(fmt: str, x: torch.Tensor):
    from qgather.impls.te.quantizers import TEUnavailable, make_quantizer

    if fmt.startswith("nvfp4"):
        from transformer_engine.pytorch.tensor import NVFP4Quantizer

        from qgather.impls.te.tensors import nvfp4_tensor_from_bits

        return nvfp4_tensor_from_bits(fmt, x, NVFP4Quantizer(with_2d_quantization=fmt == "nvfp4_2d"))
    try:
        return make_quantizer(fmt)(x)
    except TEUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_te_dequantizes_row_blocks_as_the_whole(fmt, te_ready, monkeypatch):
    from qgather.impls.te.adapter import TEAdapter
    from qgather.impls.te.tensors import row_slice

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(SHAPE, generator=gen, device="cuda")
         * torch.exp2(torch.linspace(-6, 6, SHAPE[0], device="cuda")).reshape(-1, 1)).to(torch.bfloat16)
    param = _te_tensor(fmt, x)
    whole = param.dequantize(dtype=torch.float32)
    # 300 rows' worth: blocks round down to whole 128-row scale groups (TE checks NVFP4/MXFP8 scale
    # shapes against 128-row padding; a 16-row multiple such as 288 made TE refuse a block)
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", 300 * SHAPE[1])
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", 300 * SHAPE[1])
    blocks = FORMATS[fmt].row_blocks(SHAPE)
    assert blocks == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert row_slice(param, FORMATS[fmt], *blocks[0]) is not None, "the tensor was not cut: nothing tested"
    pieces = list(TEAdapter().own_dequantize_blocks(param, FORMATS[fmt], blocks))
    assert [p.shape[0] for p in pieces] == [stop - start for start, stop in blocks]
    assert torch.equal(torch.cat(pieces).view(torch.int32), whole.view(torch.int32))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_the_blocked_forward_weight_is_tes_own_rounding(fmt, te_ready, monkeypatch):
    """The te adapter's forward rounds float32 row blocks into the layer's dtype: the same bits as
    TE's own dequantize(dtype=bfloat16) of the whole tensor."""
    from qgather.impls.te.adapter import TEAdapter

    x = torch.randn(SHAPE, generator=torch.Generator(device="cuda").manual_seed(9), device="cuda").to(torch.bfloat16)
    param = _te_tensor(fmt, x)
    whole = param.dequantize(dtype=torch.bfloat16)
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", 300 * SHAPE[1])
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", 300 * SHAPE[1])
    from qgather.impls.te.tensors import row_layout_of

    layout = row_layout_of(param)
    assert layout is not None and layout.rowwise_rows == FORMATS[fmt].rowwise_rows, "not cut: nothing tested"
    blocked = TEAdapter()._dequantized_in(param, torch.bfloat16)
    assert torch.equal(blocked.view(torch.int16), whole.view(torch.int16))


@pytest.mark.parametrize("fmt", ("fp8_block", "fp8_block_1x128", "mxfp8"))
def test_quantizing_one_usage_at_a_time_gives_the_bits_of_one_pass(fmt, te_ready):
    """The golden's cross-check quantizes a large weight with TE one usage at a time
    (te_quantize_by_usage): each part must be the same bits as TE's pass with both usages."""
    from qgather.impls.te.quantizers import TEUnavailable, te_quantize, te_quantize_by_usage

    x = torch.randn(SHAPE, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda").to(torch.bfloat16)
    try:
        whole = te_quantize(fmt, x)
    except TEUnavailable as exc:
        pytest.skip(str(exc))
    parts = list(te_quantize_by_usage(fmt, x))
    assert [sorted(p) for p in parts] == [["rowwise_data", "rowwise_scale_inv"],
                                          ["columnwise_data", "columnwise_scale_inv"]]
    valid = FORMATS[fmt].valid_regions(SHAPE)  # TE leaves the scales' padding unwritten: not compared
    for part in parts:
        for name, tensor in part.items():
            got, want = tensor[valid[name]], whole[name][valid[name]]
            assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_the_blocked_output_check_is_bit_for_bit_on_both_sides(te_ready, monkeypatch):
    """A large weight's layer output comes row block by row block (TEAdapter.forward_rows), and the
    golden layer's with the same blocks: a gathered weight equal to the golden gives equal bits."""
    from qgather.check.golden import golden_for
    from qgather.check.inspection import Inspector
    from qgather.impls.te.adapter import TEAdapter
    from qgather.model.case import CaseSpec, shard_layout

    x = torch.randn(SHAPE, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda").to(torch.bfloat16)
    param = _te_tensor("fp8_block", x)
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", 300 * SHAPE[1])
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", 300 * SHAPE[1])
    spec = CaseSpec.parse(f"te:fp8_block:{SHAPE[0]}x{SHAPE[1]}:bf16:ws2:gather:s0")
    impl = TEAdapter()
    golden = golden_for(FORMATS["fp8_block"], x, impl)
    layer_input = torch.randn(4, SHAPE[1], device="cuda")
    inspector = Inspector(spec, impl, FORMATS["fp8_block"], layer_input, shard_layout(spec))
    output, _, error = inspector._forward(param, golden)
    assert error == "" and output.equal, output
    assert impl.forward_rows(param, layer_input.to(torch.bfloat16), 0, 256) is not None, "not cut: nothing tested"
