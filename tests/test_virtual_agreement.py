"""The virtual scenario gives the real gather's verdict, not only for the reference (cases/ checks
that) but for every zoo mutant's gather case and for the external adapters of tests/_why_adapters.py."""

from __future__ import annotations

import pytest

from qgather.engine.run import RunOptions, run_case
from qgather.impls.mutants import MUTANTS
from qgather.model.case import CaseSpec
from qgather.runtime import shutdown_pools

CPU = RunOptions("gloo", "cpu", 60.0)
# the virtual scenario has no fully_shard, so only cases in FSDP2's default configuration can agree with it
ZOO = [c for m in MUTANTS for c in m.catching_cases
       if CaseSpec.parse(c).scenario == "gather" and CaseSpec.parse(c).config.is_default]
EXTERNAL = [f"tests._why_adapters:{case}" for case in (
    "WrongBytesThenRaisingForward:nvfp4_2d:128x64:bf16:ws2:gather:s0",
    "ChecksOnlyItsOwnShard:fp8_block:255x128:bf16:ws2:gather:s0",
    "AlwaysRaisingMakeParam:nvfp4_2d:136x64:bf16:ws2:gather:s0",
    "DriftingQuantizer:fp8_tensor:128x64:bf16:ws2:gather:s0",
)]


@pytest.fixture(scope="module", autouse=True)
def _stop_pools_after_module():
    yield
    shutdown_pools(keep_helpers=True)  # the next module's pools fork from the same warm forkserver


@pytest.mark.parametrize("case_id", ZOO + EXTERNAL)
def test_virtual_gives_the_real_verdict(case_id):
    real = CaseSpec.parse(case_id)
    virtual = CaseSpec(real.impl, real.fmt, real.shape, real.dtype, real.world_size, "virtual", real.seed)
    a, b = run_case(real, CPU), run_case(virtual, CPU)
    assert a.verdict is b.verdict, f"real:\n{a.render()}\nvirtual:\n{b.render()}"


def test_the_zoo_has_gather_cases_to_agree_on():
    assert len(ZOO) >= 8


def test_virtual_ranks_post_process_apart_when_their_metadata_differs_in_any_byte():
    """qgather.scenarios.virtual post-processes each distinct metadata once: a difference past the
    first elements (a per-block scale of one rank) or one the elements' sum hides still counts."""
    import torch

    from qgather.scenarios.virtual import _metadata_key

    a = torch.ones(128)
    b, c = a.clone(), a.clone()
    b[100], c[100], c[101] = 2.0, 2.0, 0.0
    metas = [{"scales": t, "layout": ("rows", 4)} for t in (a, a.clone(), b, c)]
    keys = [_metadata_key(m) for m in metas]
    assert keys[0] == keys[1] and len(set(keys)) == 3
    assert _metadata_key({"scales": a.to(torch.bfloat16)}) != _metadata_key({"scales": a})
