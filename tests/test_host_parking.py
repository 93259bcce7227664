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


# ------------------------------------------------------------------ a kept golden steps aside for the first unshard
def _kept_golden(fmt: str):
    golden = golden_module.golden_for(FORMATS[fmt], _weight())
    golden.keep_on_device()
    return golden


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4_2d"])
def test_a_golden_aside_reads_the_same_blocks_and_comes_back_as_it_was(fmt, host_on_cpu, monkeypatch):
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    kept, golden = _kept_golden(fmt), _kept_golden(fmt)
    before = dict(golden.q.buffers)
    views = golden._held_views()
    assert (views == ["columnwise_data"]) == (fmt == "fp8_block")  # fp8_block's columnwise bytes: a view
    assert golden.step_aside() and golden._aside is not None
    held = dict(golden.q.buffers)
    aside = {n for n, (axis, _) in FORMATS[fmt].rowwise_rows.items() if axis == 0}  # the buffers along the rows
    assert set(golden._aside.names) == aside and aside
    assert all((held[n] is not before[n]) == (n in aside) for n in before if n not in views)  # their host copies
    assert golden._held_views() == views  # views of the copies
    assert golden.q.mismatches(kept.q) == []  # every check reads the same bits meanwhile
    blocks = list(golden.dequantized_blocks(deferred=True))
    assert len(blocks) > 1 and golden._aside is not None  # read on the way back, block by block
    for (rows, got), (want_rows, want) in zip(blocks, kept.dequantized_blocks(), strict=True):
        values = got.values() if isinstance(got, golden_module.Deferred) else got
        assert rows == want_rows and torch.equal(values.view(torch.int32), want.view(torch.int32))
    golden.arrived()
    assert golden._aside is None and golden.q.mismatches(kept.q) == [] and golden._held_views() == views
    assert all((golden.q.buffers[n] is not held[n]) == (n in aside) for n in held if n not in views)  # came back
    copies = len(host_on_cpu)
    assert golden.step_aside() and len(host_on_cpu) == copies  # the host copies are made once
    golden.keep_on_device()  # the next case finds it back
    assert golden._aside is None and golden.q.mismatches(kept.q) == []


def test_a_golden_aside_comes_back_whole_for_any_other_read(host_on_cpu, monkeypatch):
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
    kept, golden = _kept_golden("fp8_block"), _kept_golden("fp8_block")
    assert golden.step_aside()
    assert torch.equal(golden.dequantized_as(torch.bfloat16), kept.dequantized_as(torch.bfloat16))
    assert golden._aside is None  # the values made whole: the way back ended first
    small = _kept_golden("fp8_block")
    monkeypatch.setattr(host, "worth_parking", lambda nbytes, device: False)
    assert not small.step_aside() and small._aside is None  # a small golden stays where it is


def gather_with_golden_aside(ctx, case_id: str, aside: bool) -> tuple[int, int, list]:
    """On a pool rank: the case twice from a fresh cache (the second finds its golden kept), with small
    check blocks, and with `aside` every tensor worth parking (a clone standing in for the pinned copy):
    how many times a golden stepped aside, how many check blocks were read on its way back, and the results."""
    from qgather.scenarios.registry import run_on_rank

    ctx.kept.clear()
    stepped: list[bool] = []
    read: list[tuple[int, int, int]] = []  # the check blocks read on the way back
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(format_base, "ROW_BLOCK_ELEMENTS", SMALL_BLOCKS)
        patch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", SMALL_BLOCKS)
        if aside:
            patch.setattr(host, "worth_parking", lambda nbytes, device: True)
            patch.setattr(host, "pinned_copy", lambda tensor: tensor.clone())
            step_aside, arriving = golden_module.Golden.step_aside, golden_module.Golden._arriving_rows
            patch.setattr(golden_module.Golden, "step_aside", lambda self: stepped.append(step_aside(self)) or
                          stepped[-1])
            patch.setattr(golden_module.Golden, "_arriving_rows", lambda self, *rows: read.append(rows) or
                          arriving(self, *rows))
        results = [run_on_rank(ctx, CaseSpec.parse(case_id)) for _ in range(2)]
    ctx.kept.clear()
    return sum(stepped), len(read), results


class OwnDequantizing(ReferenceImplementation):
    """The reference with a dequantization of its own: the inspection reads the golden block by block,
    deferred (the blocks a golden on its way back serves once they are there)."""

    def own_dequantize(self, param):
        return param.dequantize()


@pytest.mark.parametrize("case_id", ["tests.test_host_parking:OwnDequantizing:fp8_block:1024x64:bf16:ws2:gather:s0",
                                     "mutant:nibble_swap:nvfp4_2d:512x64:bf16:ws2:gather:s0"])
def test_a_case_whose_golden_steps_aside_for_the_first_unshard_gets_the_same_records(case_id):
    from qgather.runtime import PoolSpec, get_pool

    pool = get_pool(PoolSpec("gloo", 2, "cpu"))
    plain = pool.run(gather_with_golden_aside, case_id, False, timeout=120)
    aside = pool.run(gather_with_golden_aside, case_id, True, timeout=120)
    assert plain.status == aside.status == "ok", (plain.summary(), aside.summary())
    for (_, _, plain_runs), (stepped, read, aside_runs) in zip(plain.results, aside.results, strict=True):
        assert stepped == 2, "no golden stepped aside: the test proves nothing"
        assert read == (2 * 8 if "OwnDequantizing" in case_id else 0)  # 1024x64 in 8 check blocks, in each case
        for one, other in zip(plain_runs, aside_runs, strict=True):
            assert other.stages == one.stages and other.wire == one.wire
    first = plain.results[0][2][0].stages[0]
    assert ("nibble_swap" in case_id) == bool(first.buffer_diffs)  # the right bytes EXACT, the wrong ones found
    assert "nibble_swap" in case_id or first.own_dequantized.equal  # the library's own values compared


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU the probe runs on")
def test_the_park_probe_without_a_gpu_skips_in_one_line(capsys):
    from qgather.tools.bench import park_probe

    assert park_probe.main(["--case", "te:nvfp4_2d:8192x28672:bf16:ws2:gather:s0"]) == 0
    assert capsys.readouterr().out.strip() == "park_probe: skipped: needs CUDA GPUs"
    assert all(CaseSpec.parse(case).world_size == 2 for case in park_probe.CASES)  # bench gpu's two cases
