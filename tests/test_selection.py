"""qgather.suite.selection: what a selection runs, and which listed values match no case."""

from __future__ import annotations

from qgather.model.case import CaseSpec
from qgather.suite.selection import runnable, unmatched, why_empty


def _case(impl: str, fmt: str = "fp8_tensor", ws: int = 2, scenario: str = "gather") -> CaseSpec:
    return CaseSpec(impl, fmt, (128, 64), "bf16", ws, scenario, 0)


def test_runnable_keeps_the_named_implementations_in_what_they_declare():
    cases = [_case("reference"), _case("torchao"), _case("torchao", fmt="nvfp4_2d"),
             _case("reference", scenario="model")]
    assert runnable(cases, ["reference"], "cpu") == [cases[0]]
    assert runnable(cases, None, "cpu") == cases[:2]  # the default run keeps the companions it declares
    assert runnable([_case("te")], ["te"], "cpu") == []


def test_unmatched_names_the_values_no_case_has():
    cases = [_case("reference", ws=2), _case("reference", ws=4)]
    assert unmatched(cases, world_sizes=(2, 4)) is None
    assert unmatched(cases, world_sizes=(2, 5, 7)) == "--world-sizes 5,7: no case of the selection has world size 5,7"
    assert unmatched(cases, formats=("fp8_tensor", "mxfp8")) == (
        "--formats mxfp8: no case of the selection has format mxfp8")
    assert unmatched(cases, scenarios=("steps",)).startswith("--scenarios steps:")


def test_why_empty_says_which_implementation_runs_elsewhere():
    assert why_empty(["te", "reference"], "cpu") == "te runs on cuda only, and this run's device is cpu"
    assert why_empty(["reference"], "cpu") == ""
