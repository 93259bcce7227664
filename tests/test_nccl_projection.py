"""The NCCL projection of `qgather bench gpu`: nccl-tests' bus-bandwidth arithmetic, and the swap of
each rank's own collective in the case's run (and of the bare all-gather) for NCCL's."""

from types import SimpleNamespace

import pytest

from qgather.tools.bench.nccl_projection import (
    RankRun,
    hbm_bandwidth,
    nccl_all_gather_s,
    project,
    step_floor_bytes,
)


def test_all_gather_time_follows_the_bus_bandwidth_definition():
    # 2 ranks x 117.5 MB at 370 GB/s: 235 MB * 1/2 / 370e9
    assert nccl_all_gather_s(117_500_000, 2, 370e9) == pytest.approx(235e6 * 0.5 / 370e9)
    assert nccl_all_gather_s(1000, 8, 1e9) == pytest.approx(8000 * 7 / 8 / 1e9)
    assert nccl_all_gather_s(1000, 1) == 0.0


def test_projection_swaps_each_ranks_own_collective_and_keeps_the_longest():
    # rank 0: 0.5 s with 0.3 s of collective (0.2 s of its own work); rank 1: 0.45 s with 0.1 s (0.35 s)
    ranks = [RankRun(0, 0.5, 0.3), RankRun(1, 0.45, 0.1)]
    p = project(ranks, bare_quantize_s=0.001, bytes_per_rank=370_000, world_size=2, bus_bandwidth=370e9)
    assert p.nccl_collective_s == pytest.approx(1e-6)  # 740 kB * 1/2 / 370 GB/s
    assert (p.rank, p.measured_collective_s) == (1, 0.1)
    assert p.case_on_nccl_s == pytest.approx(0.35 + 1e-6)
    assert p.bare_on_nccl_s == pytest.approx(0.001 + 1e-6)
    assert p.ratio == pytest.approx((0.35 + 1e-6) / (0.001 + 1e-6))


def test_projection_needs_a_rank():
    with pytest.raises(ValueError, match="at least one rank"):
        project([], bare_quantize_s=0.001, bytes_per_rank=1, world_size=2)


def test_the_report_projects_from_the_runs_own_collective_not_the_bare_one():
    """Two runs whose gloo collectives differ by 40 ms project the same case: each run's own
    collective leaves; the bare all-gather's median, measured apart, plays no part."""
    from qgather.model.phases import Phase
    from qgather.tools.bench import bench_steps
    from qgather.tools.bench.bench_report import _rank_runs, _rank_steps

    def rank(rank: int, run_s: float, collective_s: float, arrived: float) -> dict:
        result = SimpleNamespace(rank=rank, seconds=((Phase.COLLECTIVE.value, collective_s),),
                                 started=((Phase.COLLECTIVE.value, arrived),))
        return {"runs": [{"full_s": run_s, "result": result}]}

    for gloo_s in (0.20, 0.24):
        # rank 1 arrives 2 ms after rank 0, whose collective holds that wait
        results = [rank(0, 0.010 + gloo_s, gloo_s + 0.002, 100.0), rank(1, 0.010 + gloo_s, gloo_s, 100.002)]
        split, _ = bench_steps.split_waits([_rank_steps(r["runs"][0]["result"]) for r in results])
        p = project(_rank_runs(results, split, 0), bare_quantize_s=0.002, bytes_per_rank=370_000, world_size=2,
                    bus_bandwidth=370e9)
        assert p.case_on_nccl_s == pytest.approx(0.010 + 1e-6)  # the wait stays in rank 0's run


def test_hbm_floor_names_its_card_and_grows_with_the_own_quantizer():
    assert hbm_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert "unknown card" in hbm_bandwidth("cpu")[1]
    mine, theirs = step_floor_bytes(100, 50, 2, True), step_floor_bytes(100, 50, 2, False)
    assert mine["golden"] > theirs["golden"] and mine["collective"] == theirs["collective"] == 2 * 50 // 2 + 100
