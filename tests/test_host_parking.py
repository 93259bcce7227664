"""A large golden or weight waits in host memory while a GPU case does something else
(qgather.check.host): every record of a case must be the one of a golden that never left the
device. On CPU the host copies are stand-ins (clones), so that the parked code paths run here;
tests/gpu/test_golden_park.py moves real pinned buffers on a GPU."""

from __future__ import annotations

import pytest
import torch

from qgather.check import golden as golden_module
from qgather.check import host
from qgather.formats import FORMATS
from qgather.formats import base as format_base
from qgather.impls.reference import ReferenceImplementation
from qgather.model.case import CaseSpec

SMALL_BLOCKS = 128 * 64


@pytest.fixture
def host_on_cpu(monkeypatch):
    """Every tensor is worth parking, and a clone stands in for the pinned copy."""
    copies = []

    def clone(tensor):
        copies.append(tensor.shape)
        return tensor.clone()

    monkeypatch.setattr(host, "worth_parking", lambda nbytes, device: True)
    monkeypatch.setattr(host, "pinned_copy", clone)
    return copies


def _weight(shape=(512, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(shape, generator=g) * torch.exp2(torch.linspace(-6, 6, shape[0])).reshape(-1, 1)).bfloat16()


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4_2d", "fp8_tensor"])
def test_a_parked_golden_dequantizes_as_one_on_the_device(fmt, host_on_cpu, monkeypatch):
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    weight = _weight()
    kept = golden_module.golden_for(FORMATS[fmt], weight)
    parked = golden_module.golden_for(FORMATS[fmt], weight, parked=True)
    assert parked.parked and not kept.parked and host_on_cpu
    pairs = list(zip(kept.dequantized_blocks(), parked.dequantized_blocks(), strict=True))
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in pairs)
    assert torch.equal(kept.dequantized_as(torch.bfloat16), parked.dequantized_as(torch.bfloat16))
    assert parked.device == kept.q.device


class _OneBitOff(ReferenceImplementation):
    """Its own quantizer differs from the reference in one bit of the rowwise data."""

    def own_quantization(self, fmt, weight):
        q = FORMATS[fmt].quantize(weight)
        q.buffers["rowwise_data"].view(-1)[0] ^= 1
        return dict(q.buffers)


def test_the_own_quantizer_is_cross_checked_against_a_parked_reference(host_on_cpu):
    weight, fmt = _weight(), FORMATS["fp8_block"]
    kept = golden_module.golden_for(fmt, weight, _OneBitOff())
    parked = golden_module.golden_for(fmt, weight, _OneBitOff(), parked=True)
    assert kept.quantizer_diffs == parked.quantizer_diffs and kept.quantizer_diffs
    assert parked.source == kept.source == "reference's own quantizer"
    parked.unpark()
    assert parked.q.mismatches(kept.q) == []


def test_a_golden_brought_back_parks_again_without_a_copy(host_on_cpu):
    """Each buffer's host copy is made once: parking again lets the device copy go; `keep` stays."""
    golden = golden_module.golden_for(FORMATS["fp8_block"], _weight(), parked=True)
    made = len(host_on_cpu)
    assert golden.parked and made == len(golden.q.buffers)
    golden.unpark()
    assert not golden.parked
    golden.park(keep=golden.value_buffers())
    assert len(host_on_cpu) == made and golden.parked  # no new copy
    assert set(golden._away) == set(golden.q.buffers) - set(golden.value_buffers())
    golden.unpark()
    golden.park()
    assert len(host_on_cpu) == made and golden._away == set(golden.q.buffers)
    flipped = golden.q.buffers["rowwise_data"].clone()
    flipped.view(-1)[0] ^= 1
    golden.replace_buffers({"rowwise_data": flipped})  # an own quantizer's bits stand for the golden's
    golden.unpark()
    golden.park()
    assert torch.equal(golden.q.buffers["rowwise_data"], flipped)


BLOCKED_CASES = [
    "reference:fp8_block:1024x64:bf16:ws4:gather:s0",
    "mutant:nibble_swap:nvfp4_2d:512x64:bf16:ws2:gather:s0",  # differing buffers: unparked, located
    "mutant:hp_fallback:nvfp4_2d:512x64:bf16:ws2:gather:s0",  # a plain tensor's values
]


@pytest.mark.parametrize("case_id", BLOCKED_CASES)
def test_a_case_judged_against_a_parked_golden_gets_the_same_records(case_id, host_on_cpu, monkeypatch):
    from qgather.scenarios import virtual

    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    kept = virtual.run_virtual(CaseSpec.parse(case_id))
    made = []

    def parked_golden(fmt, weight, impl=None):
        made.append(golden_module.golden_for(fmt, weight, impl, parked=True))
        return made[-1]

    monkeypatch.setattr(virtual, "golden_for", parked_golden)
    parked = virtual.run_virtual(CaseSpec.parse(case_id))
    assert made and host_on_cpu, "the golden was not parked: the test proves nothing"
    assert [repr(r) for r in parked] == [repr(r) for r in kept]


def test_park_tensor_leaves_small_or_host_tensors_alone():
    small = torch.zeros(4)
    assert host.park_tensor(small) is small
    assert not host.worth_parking(host.PARK_BYTES, torch.device("cpu"))
    assert host.worth_parking(host.PARK_BYTES, torch.device("cuda")) and not host.worth_parking(
        host.PARK_BYTES - 1, torch.device("cuda"))


class _Blockwise:
    """A TE blockwise tensor as read_te_buffers sees it: columnwise derived on request."""

    def __init__(self, scales=None):
        self._rowwise_data = torch.arange(8, dtype=torch.uint8).reshape(2, 4)
        self._rowwise_scale_inv = torch.ones(1, 1)
        self._columnwise_data, self._columnwise_scale_inv = None, scales

    def _create_columnwise(self):
        self._columnwise_data = self._rowwise_data.t().contiguous()
        self._columnwise_scale_inv = torch.full((1, 1), 2.0)


@pytest.mark.parametrize("scales", [None, torch.zeros(1, 1)])
def test_te_columnwise_derived_for_the_comparison_is_not_left_on_the_weight(scales):
    from qgather.impls.te.tensors import read_te_buffers

    param = _Blockwise(scales)
    buffers = read_te_buffers(param)
    assert torch.equal(buffers["columnwise_data"], param._rowwise_data.t())
    assert float(buffers["columnwise_scale_inv"]) == 2.0
    assert param._columnwise_data is None and param._columnwise_scale_inv is scales
