"""The NCCL projection of `qgather bench gpu`: nccl-tests' bus-bandwidth arithmetic and the swap of
the measured collective for NCCL's, in the case and in the bare work alike."""

import pytest

from qgather.tools.bench.nccl_projection import hbm_bandwidth, nccl_all_gather_s, project, step_floor_bytes


def test_all_gather_time_follows_the_bus_bandwidth_definition():
    # 2 ranks x 117.5 MB at 370 GB/s: 235 MB * 1/2 / 370e9
    assert nccl_all_gather_s(117_500_000, 2, 370e9) == pytest.approx(235e6 * 0.5 / 370e9)
    assert nccl_all_gather_s(1000, 8, 1e9) == pytest.approx(8000 * 7 / 8 / 1e9)
    assert nccl_all_gather_s(1000, 1) == 0.0


def test_projection_replaces_the_measured_collective_on_both_sides():
    p = project(case_s=0.5, bare_quantize_s=0.001, measured_collective_s=0.3, bytes_per_rank=370_000, world_size=2,
                bus_bandwidth=370e9)
    assert p.nccl_collective_s == pytest.approx(1e-6)  # 740 kB * 1/2 / 370 GB/s
    assert p.case_on_nccl_s == pytest.approx(0.2 + 1e-6)
    assert p.bare_on_nccl_s == pytest.approx(0.001 + 1e-6)
    assert p.ratio == pytest.approx((0.2 + 1e-6) / (0.001 + 1e-6))


def test_hbm_floor_names_its_card_and_grows_with_the_own_quantizer():
    assert hbm_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert "unknown card" in hbm_bandwidth("cpu")[1]
    mine, theirs = step_floor_bytes(100, 50, 2, True), step_floor_bytes(100, 50, 2, False)
    assert mine["golden"] > theirs["golden"] and mine["collective"] == theirs["collective"] == 2 * 50 // 2 + 100
