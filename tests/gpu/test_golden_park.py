"""A large golden waits in host memory while the case gathers (qgather.check.golden.Golden.park): the
comparison reads it block by block from there, and the checks that dequantize it bring back only
the buffers they read; every verdict must be the one of a golden that never left the GPU.

    python -m pytest tests/gpu/test_golden_park.py -q -p no:cacheprovider -m gpu
"""

from __future__ import annotations

import pytest
import torch

from qgather.check import golden as golden_module
from qgather.check import host
from qgather.formats import FORMATS
from qgather.instruments import compare, digest
from qgather.instruments.compare import compare_buffers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ("fp8_block", "nvfp4_1d", "fp8_tensor"))
def test_a_parked_golden_compares_as_on_the_gpu(fmt, cuda, monkeypatch):
    monkeypatch.setattr(host, "PARK_BYTES", 1)
    monkeypatch.setattr(compare, "_DEVICE_CHUNK", 4096)  # several blocks per buffer come over from the host
    weight = torch.randn(512, 256, generator=torch.Generator(device="cuda").manual_seed(1), device=cuda)
    golden = golden_module.golden_for(FORMATS[fmt], weight.to(torch.bfloat16))
    gathered = {name: t.clone() for name, t in golden.q.buffers.items()}
    assert golden.park() and golden.parked
    assert all(t.device.type == "cpu" and t.is_pinned() for t in golden.q.buffers.values())
    assert compare_buffers(gathered, golden.q) == []
    data = next(n for n in gathered if "data" in n)
    gathered[data].view(-1)[-1] ^= 1
    assert [(d.name, d.n_diff) for d in compare_buffers(gathered, golden.q)] == [(data, 1)]
    golden.unpark(golden.value_buffers())
    assert all(golden.q.buffers[n].device.type == "cuda" for n in golden.value_buffers())
    assert golden.parked == (set(golden.value_buffers()) != set(golden.q.buffers))
    golden.unpark()
    assert not golden.parked and all(t.device.type == "cuda" for t in golden.q.buffers.values())


@pytest.mark.parametrize("fmt", ("fp8_block", "nvfp4_2d"))
def test_a_parked_golden_dequantizes_block_by_block_as_on_the_gpu(fmt, cuda, monkeypatch):
    from qgather.formats import base as format_base

    monkeypatch.setattr(host, "PARK_BYTES", 1)
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", 256 * 256)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", 256 * 256)
    weight = torch.randn(1024, 256, generator=torch.Generator(device="cuda").manual_seed(2), device=cuda)
    kept = golden_module.golden_for(FORMATS[fmt], weight.to(torch.bfloat16))
    parked = golden_module.golden_for(FORMATS[fmt], weight.to(torch.bfloat16), parked=True)
    assert parked.parked and all(t.device.type == "cpu" for t in parked.q.buffers.values())
    for (rows, want), (same_rows, got) in zip(kept.dequantized_blocks(), parked.dequantized_blocks(), strict=True):
        assert rows == same_rows and got.device.type == "cuda"
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert parked.parked  # the blocks came over one by one; the golden stayed on the host


def test_te_twin_from_a_weight_on_the_host_is_the_twin_from_the_gpu(cuda):
    from qgather.impls import get_impl
    from qgather.impls.te.environment import te_import_error
    from qgather.model.case import CaseSpec

    if te_import_error():
        pytest.skip(te_import_error())
    spec = CaseSpec.parse("te:fp8_block:256x128:bf16:ws2:gather:s0")
    weight = torch.randn(256, 128, generator=torch.Generator(device="cuda").manual_seed(4), device=cuda).bfloat16()
    x = torch.randn(8, 128, generator=torch.Generator(device="cuda").manual_seed(5), device=cuda).bfloat16()
    impl = get_impl(spec.impl)
    on_gpu = impl.single_device_output(spec, weight, x)
    on_host = impl.single_device_output(spec, weight.cpu().pin_memory(), x)
    assert on_host.device.type == "cuda" and torch.equal(on_host.view(torch.int32), on_gpu.view(torch.int32))


@pytest.mark.parametrize("fmt", ("fp8_block", "nvfp4_2d"))
def test_a_parked_golden_judges_as_one_that_never_left_the_gpu(fmt, cuda, monkeypatch):
    """The inspection brings a parked golden over whole (pinned, without waiting), lets its device
    copies go again afterwards without copying back, and a gathered buffer identical to the golden
    takes the golden's digest part: the stage is the one of a golden kept on the GPU, twice over."""
    from qgather.check.inspection import Inspector
    from qgather.impls import get_impl
    from qgather.model.case import CaseSpec, shard_layout

    monkeypatch.setattr(host, "PARK_BYTES", 1)
    monkeypatch.setattr(digest, "LARGE_BUFFER_BYTES", 1024)  # the data buffers are fingerprinted on the GPU
    spec = CaseSpec.parse(f"reference:{fmt}:512x256:bf16:ws2:gather:s0")
    weight = torch.randn(512, 256, generator=torch.Generator(device="cuda").manual_seed(1), device=cuda)
    weight = weight.to(torch.bfloat16)
    impl, x = get_impl("reference"), torch.randn(4, 256, device=cuda).to(torch.bfloat16)
    inspector = Inspector(spec, impl, FORMATS[fmt], x, shard_layout(spec))
    param = impl.make_param(fmt, weight)
    kept = golden_module.golden_for(FORMATS[fmt], weight)
    parked = golden_module.golden_for(FORMATS[fmt], weight, parked=True)
    want = inspector.judge(param, kept, "unshard 1")
    pinned = {name: t.data_ptr() for name, t in parked.q.buffers.items()}
    for _ in range(2):
        assert inspector.judge(param, parked, "unshard 1") == want
        assert parked.parked and {n: t.data_ptr() for n, t in parked.q.buffers.items()} == pinned
    assert parked._digest_parts  # the second judge took them from the golden


@pytest.mark.parametrize("fmt", ("fp8_block", "nvfp4_2d"))
def test_a_kept_golden_steps_aside_for_the_unshard_and_is_read_on_its_way_back(fmt, cuda, monkeypatch):
    """Golden.step_aside lets the device copy of a kept golden's large buffers go (the allocator holds
    that much less), `come_back` copies them back on a stream of the golden's own while the case's
    stream runs other work, each deferred check block is read once its copies are done, and `arrived`
    leaves the golden on the device as it was, bit for bit, with fp8_block's columnwise view."""
    from qgather.formats import base as format_base
    from qgather.instruments.compare import Deferred

    monkeypatch.setattr(host, "PARK_BYTES", 1 << 16)
    monkeypatch.setattr(format_base, "ROW_BLOCK_ELEMENTS", 1 << 20)
    monkeypatch.setattr(format_base, "CHECK_BLOCK_ELEMENTS", 1 << 20)
    weight = torch.randn(4096, 1024, generator=torch.Generator(device="cuda").manual_seed(6), device=cuda)
    kept = golden_module.golden_for(FORMATS[fmt], weight.bfloat16())
    golden = golden_module.golden_for(FORMATS[fmt], weight.bfloat16())
    golden.keep_on_device()
    views = golden._held_views()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert golden.step_aside()
    aside = golden._aside.names
    freed = sum(kept.q.buffers[n].numel() * kept.q.buffers[n].element_size() for n in aside)
    assert torch.cuda.memory_allocated() == before - freed and "rowwise_data" in aside
    busy = torch.randn(4096, 4096, device=cuda)  # the case's stream has work queued while the copies run
    for _ in range(20):
        busy = busy @ busy / 64
    golden.come_back()
    blocks = list(golden.dequantized_blocks(deferred=True))
    assert len(blocks) > 1 and golden._aside is not None
    for (rows, got), (want_rows, want) in zip(blocks, kept.dequantized_blocks(), strict=True):
        values = got.values() if isinstance(got, Deferred) else got
        assert rows == want_rows and torch.equal(values.view(torch.int32), want.view(torch.int32))
    golden.arrived()
    assert golden._aside is None and golden._held_views() == views
    assert all(t.device.type == "cuda" for t in golden.q.buffers.values())
    assert golden.q.mismatches(kept.q) == []
