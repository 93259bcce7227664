"""Two goldens: an implementation with its own quantizer is judged against its own q(W), so a format
registered with its layout alone (no reference quantizer in qgather) is testable too."""

from __future__ import annotations

import pytest
import torch  # noqa: I001 - after the harness, as the other tests

from qgather.engine.run import RunOptions, run_case
from qgather.formats import FORMATS, QuantizedTensor
from qgather.formats.fp8_tensor import Fp8TensorFormat
from qgather.formats.numerics import FP8_E4M3_MAX
from qgather.impls import _CACHE
from qgather.impls.reference import QuantizedParam, ReferenceImplementation
from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict

NAME = "fp8_layout_only"


class LayoutOnly(Fp8TensorFormat):
    """FP8 per-tensor's layout, but no quantizer: qgather cannot produce a golden of its own."""

    def _quantize(self, x2, amax, shape):
        raise NotImplementedError(f"{self.name}: no reference quantizer")


class LibraryQuantizer(ReferenceImplementation):
    """A library's own quantizer for that format (here: FP8 per-tensor current scaling)."""

    name = "library"
    formats = (NAME,)
    quantize_with = FORMATS["fp8_tensor"]

    def make_param(self, fmt, weight):
        own = self.quantize_with.quantize(weight)
        q = QuantizedTensor(fmt, own.shape, own.buffers, own.valid)
        rows, glob = FORMATS[fmt].to_rows(q)
        return QuantizedParam(FORMATS[fmt], rows, glob, tuple(weight.shape), weight.dtype, te=dict(q.buffers))

    def own_quantization(self, fmt, weight):
        return dict(self.quantize_with.quantize(weight).buffers)


class NoQuantizerAtAll(LibraryQuantizer):
    name = "no-quantizer"

    def own_quantization(self, fmt, weight):
        return None


@pytest.fixture
def layout_only_format():
    FORMATS[NAME] = LayoutOnly(NAME, torch.float8_e4m3fn, FP8_E4M3_MAX)
    _CACHE["library"], _CACHE["no-quantizer"] = LibraryQuantizer(), NoQuantizerAtAll()
    yield
    del FORMATS[NAME], _CACHE["library"], _CACHE["no-quantizer"]


def test_a_format_without_a_reference_quantizer_is_judged_against_the_own_quantizer(layout_only_format):
    report = run_case(CaseSpec("library", NAME, (128, 64), "bf16", 4, "virtual"), RunOptions(device="cpu"))
    assert report.verdict is Verdict.EXACT, report.render()


def test_without_any_quantizer_there_is_nothing_to_judge_and_it_says_so(layout_only_format):
    report = run_case(CaseSpec("no-quantizer", NAME, (128, 64), "bf16", 4, "virtual"), RunOptions(device="cpu"))
    assert report.verdict is Verdict.ERROR and "nothing to judge the gather against" in report.reason
