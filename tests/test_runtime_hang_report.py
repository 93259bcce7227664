"""A HANG report points at where each rank is stuck: the adapter's own code when it spins there,
the collective when it waits in one; a hung case re-run under TORCH_DISTRIBUTED_DEBUG=DETAIL adds
which collectives mismatched. The hangs are real (tests/_hang_adapters.py), bounded by HANG_S."""

from __future__ import annotations

import pytest

from qgather.engine.run import RunOptions, run_case
from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict
from qgather.runtime import shutdown_pools

HANG_S = 6.0
SHAPE = "nvfp4_2d:128x64:bf16:ws2:gather:s0"


@pytest.fixture(scope="module", autouse=True)
def _stop_pools_after_module():
    yield
    shutdown_pools(keep_helpers=True)  # the next module's pools fork from the same warm forkserver


def _hang_report(adapter: str, detail: bool) -> str:
    # A case that passes first, with time to spare, on the pool the hang then uses (a HANG replaces
    # it): a cold pool's ranks import the scenario's modules inside their first case, which on a loaded
    # machine took longer than HANG_S and ended the hang in an import instead of where it hangs.
    warm = run_case(CaseSpec.parse(f"tests._hang_adapters:EndsWell:{SHAPE}"), RunOptions("gloo", "cpu", 120.0))
    assert warm.verdict == Verdict.EXACT, warm.render()
    spec = CaseSpec.parse(f"tests._hang_adapters:{adapter}:{SHAPE}")
    report = run_case(spec, RunOptions("gloo", "cpu", HANG_S, detail_on_hang=detail))
    assert report.verdict == Verdict.HANG, report.render()
    return report.render()


def test_hang_in_adapter_code_names_the_adapter_function():
    text = _hang_report("HangsInAdapter", detail=False)
    head = text.splitlines()[0]
    assert "ranks 0,1 were in wait_for_a_peer_that_never_comes (_hang_adapters.py:" in head
    assert "collective" not in head
    rank0 = text.split("rank 0 stack (innermost first):\n", 1)[1].splitlines()
    assert rank0[0].strip().startswith("wait (")  # innermost first: threading's wait, then the adapter
    assert any(line.strip().startswith("wait_for_a_peer_that_never_comes (") for line in rank0[:3])
    assert "TORCH_DISTRIBUTED_DEBUG" not in text


def test_hang_in_a_collective_names_it_and_the_detail_rerun_names_the_mismatch():
    text = _hang_report("SkipsACollective", detail=True)
    head = text.splitlines()[0]
    assert "rank 1 was waiting in a collective (barrier)" in head
    assert "rank 0 was waiting in a collective (all_gather" in head
    assert "  barrier (torch/distributed/distributed_c10d.py:" in text
    evidence = [line for line in text.splitlines() if "TORCH_DISTRIBUTED_DEBUG=DETAIL re-run" in line]
    assert len(evidence) == 1, text
    assert "mismatched collectives:" in evidence[0] and "rank 1 in BARRIER" in evidence[0]
    assert "rank 0 in _ALLGATHER_BASE" in evidence[0]


def test_a_hang_report_says_what_each_waiting_rank_handed_the_gather():
    # rank 0 got as far as FSDP2's all-gather: its pre-hook outputs and its bytes are the evidence
    text = _hang_report("SkipsACollective", detail=False)
    line = next(line for line in text.splitlines() if line.strip().startswith("rank 0: all-gather:"))
    assert "bytes from this rank" in line and "pre-hook handed: uint8[" in line
    assert not any(line.strip().startswith("rank 1: all-gather") for line in text.splitlines())


def test_hang_with_unequal_gather_sizes_says_so():
    from qgather.runtime.outcome import CaseOutcome

    def hang(notes):
        return CaseOutcome("hang", [None, None], duration_s=30.0, unfinished=(0, 1), notes=notes)

    text = hang({0: {"all-gather": "16400 bytes from this rank"}, 1: {"all-gather": "32768 bytes from this rank"}})
    assert "different sizes (bytes: rank 0 16400, rank 1 32768)" in text.summary()
    same = hang({0: {"all-gather": "8 bytes from this rank"}, 1: {"all-gather": "8 bytes from this rank"}})
    assert "different sizes" not in same.summary()


def test_a_case_whose_ranks_stand_still_after_unequal_gather_sizes_ends_before_its_deadline(monkeypatch):
    """The stall's evidence (qgather.runtime.stall) ends the case as HANG once every rank stood still for
    STALL_EVIDENCE_S after handing one all-gather unequal sizes; alike sizes wait for the deadline. The
    evidence window is shortened here (it is the parent's) to keep the test at a few seconds."""
    from qgather.runtime import get_pool, stall
    from qgather.runtime.spec import PoolSpec
    from tests._hang_adapters import equal_gather_then_stand_still, unequal_gather_then_stand_still

    monkeypatch.setattr(stall, "STALL_EVIDENCE_S", 1.0)
    pool = get_pool(PoolSpec("gloo", 2, "cpu"))
    unequal = pool.run(unequal_gather_then_stand_still, timeout=120.0, case_id="unequal")
    assert unequal.status.value == "hang" and unequal.note == stall.STALL_NOTE, unequal.summary()
    assert unequal.duration_s < 30.0, unequal.summary()
    assert "different sizes (bytes: rank 0 1024, rank 1 2048)" in unequal.summary()
    equal = pool.run(equal_gather_then_stand_still, timeout=3.0, case_id="equal")
    assert equal.status.value == "hang" and equal.note == "" and equal.duration_s >= 3.0, equal.summary()
