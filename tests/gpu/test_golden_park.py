"""A large golden waits in host memory while the case gathers (qgather.check.golden.Golden.park): the
comparison reads it block by block from there, and the checks that dequantize it bring back only
the buffers they read; every verdict must be the one of a golden that never left the GPU.

    python -m pytest tests/gpu/test_golden_park.py -q -p no:cacheprovider -m gpu
"""

from __future__ import annotations

import pytest
import torch

from qgather.check import compare
from qgather.check import golden as golden_module
from qgather.check.compare import compare_buffers
from qgather.formats import FORMATS

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.mark.parametrize("fmt", ("fp8_block", "nvfp4_1d", "fp8_tensor"))
def test_a_parked_golden_compares_as_on_the_gpu(fmt, cuda, monkeypatch):
    monkeypatch.setattr(golden_module, "PARK_BYTES", 1)
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
