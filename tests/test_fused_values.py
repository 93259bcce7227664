"""qgather's Triton kernels count what the eager comparison counts: those that dequantize a golden's row
block in registers (qgather.instruments.fused_values) and the buffer comparisons (fused.count_by_triton,
flat and tiled), run in Triton's interpreter on the CPU where Triton is installed (the dev extra
installs it; tests/gpu/test_fused_compare.py runs them compiled, on a GPU).

The interpreter is switched on by TRITON_INTERPRET before Triton is imported, for a whole process:
the checks run in a process of their own (this file, run as a script), so that no kernel of the
process running the tests is ever built for the interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from qgather.check.golden import golden_for
from qgather.formats import FORMATS
from qgather.formats import base as format_base
from qgather.formats import numerics as nx
from qgather.instruments import fused, fused_values
from qgather.instruments.compare import Deferred

HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness")
FORMAT_NAMES = ("fp8_block", "nvfp4_2d", "nvfp4_1d")
SHAPES = ((512, 384), (400, 272))  # whole programs of the kernels or not
N_DIFFS = (0, 1, 37)

# One xdist worker runs the whole module (`make test` uses --dist loadgroup): the probe's process runs once,
# not once in each worker that draws one of its tests.
pytestmark = pytest.mark.xdist_group("fused_values")


def _deferred_blocks(fmt_name: str, shape: tuple[int, int], seed: int = 0) -> list[Deferred]:
    """The golden's row blocks of a weight of `shape`, deferred, 128 rows each."""
    format_base.ROW_BLOCK_ELEMENTS = 1 << 12
    format_base.CHECK_BLOCK_ELEMENTS = shape[1] * 128
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, shape[0]).reshape(-1, 1)
    golden = golden_for(FORMATS[fmt_name], torch.randn(shape, generator=generator) * scales)
    blocks = [want for _, want in golden.dequantized_blocks(deferred=True)]
    assert len(blocks) > 1 and all(isinstance(want, Deferred) for want in blocks)
    return blocks


def _flipped(values: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """A copy of `values` with the last mantissa bit of `n` elements flipped."""
    got = values.clone()
    where = torch.randperm(got.numel(), generator=torch.Generator().manual_seed(seed))[:n]
    got.view(-1).view(torch.int32)[where] ^= 1
    return got


def _eager(got: torch.Tensor, want: Deferred) -> int:
    return int((got.view(torch.int32) != want.values().view(torch.int32)).sum())


def _counted(got: torch.Tensor, want: Deferred) -> int | None:
    count = fused_values.count(got, want.fn, want.tensors)
    return None if count is None else int(count)


def _planted(fmt_name: str, shape: tuple[int, int], n_diff: int) -> list[list]:
    """(kernel count, eager count, planted) for every block of the golden, `n_diff` planted in each."""
    out = []
    for i, want in enumerate(_deferred_blocks(fmt_name, shape)):
        got = _flipped(want.values(), n_diff, seed=i)
        out.append([_counted(got, want), _eager(got, want), n_diff])
    return out


def _wrong_scales(fmt_name: str) -> list:
    """A block dequantized with the next block's scales (what a shard-alignment bug gives)."""
    first, second = _deferred_blocks(fmt_name, (512, 256))[:2]
    swapped = Deferred(first.fn, (first.tensors[0], second.tensors[1], *first.tensors[2:]), first.shape)
    got = swapped.values()
    return [_counted(got, first), _eager(got, first), got.numel()]


def _overflowing_factor() -> list:
    """numerics.nvfp4_dequant_factor's other order, where s * amax is infinite."""
    want = _deferred_blocks("nvfp4_2d", (256, 256))[-1]
    amax = torch.tensor([3.0e38])
    huge = Deferred(want.fn, (want.tensors[0], want.tensors[1], amax, want.tensors[3]), want.shape)
    overflows = bool(torch.isinf(nx.fp8_values(want.tensors[1], torch.float8_e4m3fn) * amax).any())
    got = _flipped(huge.values(), 5, seed=3)
    return [_counted(got, huge), _eager(got, huge), 5, overflows, bool(torch.isfinite(got).all())]


def _declined() -> list:
    """What the kernels leave to the compiled comparison: None each."""
    want = _deferred_blocks("fp8_block", (256, 256))[0]
    got = want.values()
    nvfp4 = _deferred_blocks("nvfp4_2d", (256, 256))[0]
    other_table = nvfp4.tensors[3] * 2  # not the E2M1 values the kernel decodes
    return [fused_values.count(got, lambda *t: want.fn(*t), want.tensors),  # not a format's own function
            fused_values.count(got.to(torch.bfloat16), want.fn, want.tensors),  # compared as float32 there
            fused_values.count(got.t(), want.fn, want.tensors),  # not contiguous
            fused_values.count(nvfp4.values(), nvfp4.fn, (*nvfp4.tensors[:3], other_table)),
            fused_values.count(got, want.fn, (want.tensors[0], want.tensors[1][:, :1]))]  # too few tile scales


def _buffers() -> dict:
    """count_by_triton of two contiguous buffers (flat) and of a buffer against a transposed view
    (tiled), with differences planted, against the eager count."""
    out = {}
    for dtype in (torch.uint8, torch.int32):
        rowwise = torch.randint(0, 120, (300, 260), dtype=dtype, generator=torch.Generator().manual_seed(1))
        got = rowwise.t().contiguous()
        got.view(-1)[torch.randperm(got.numel(), generator=torch.Generator().manual_seed(2))[:41]] += 1
        for layout, want in (("tiled", rowwise.t()), ("flat", rowwise.t().contiguous())):
            counted = fused.count_by_triton(got, want)
            out[f"{layout}-{dtype}"] = [None if counted is None else int(counted), int((got != want).sum()), 41]
    return out


def _probe() -> dict:
    results = {f"{f}-{s[0]}x{s[1]}-{n}": _planted(f, s, n) for f in FORMAT_NAMES for s in SHAPES for n in N_DIFFS}
    results.update({f"wrong-scales-{f}": _wrong_scales(f) for f in ("fp8_block", "nvfp4_2d")})
    results["overflow"] = _overflowing_factor()
    results["declined"] = _declined()
    results.update(_buffers())
    return results


@pytest.fixture(scope="module")
def probed() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed here: its interpreter runs these kernels on the CPU")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (HARNESS, os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n_diff", N_DIFFS)
def test_a_kernel_counts_what_the_made_values_count(probed, fmt_name, shape, n_diff):
    blocks = probed[f"{fmt_name}-{shape[0]}x{shape[1]}-{n_diff}"]
    assert len(blocks) > 1
    for counted, eager, planted in blocks:
        assert counted is not None, "no kernel ran: nothing tested"
        assert counted == eager == planted


@pytest.mark.parametrize("fmt_name", ("fp8_block", "nvfp4_2d"))
def test_a_block_dequantized_with_the_wrong_scales_differs_wholesale(probed, fmt_name):
    counted, eager, numel = probed[f"wrong-scales-{fmt_name}"]
    assert counted == eager > numel // 2


def test_nvfp4_factor_takes_the_other_order_where_scale_times_amax_overflows(probed):
    counted, eager, planted, overflows, finite = probed["overflow"]
    assert overflows and finite, "the other order was not exercised"
    assert counted == eager == planted


@pytest.mark.parametrize("layout", ("flat", "tiled"))
@pytest.mark.parametrize("dtype", (torch.uint8, torch.int32))
def test_the_buffer_kernels_count_what_the_eager_comparison_counts(probed, layout, dtype):
    counted, eager, planted = probed[f"{layout}-{dtype}"]
    assert counted is not None, "no kernel ran: nothing tested"
    assert counted == eager == planted


def test_no_kernel_for_a_function_of_its_own_or_other_values(probed):
    assert probed["declined"] == [None] * 5


if __name__ == "__main__":
    print(json.dumps(_probe()))
