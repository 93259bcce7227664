"""`qgather bench gpu` measures a full case against the bare work it wraps; on a host without the GPUs
it asks for it says so in one line and exits 0 (so `qgather bench` runs everywhere)."""

from __future__ import annotations

import pytest
import torch

from qgather.tools import case_bench


def test_a_cpu_dry_run_prints_a_ratio_per_format(capsys):
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", "reference", "--reps", "1",
                          "--formats", "nvfp4_2d,fp8_tensor"])
    out = capsys.readouterr().out
    assert rc in (0, 1), out  # 1: the goal missed, which tiny CPU shapes may do
    for fmt in ("nvfp4_2d", "fp8_tensor"):
        assert f"{fmt}: reference:{fmt}:128x64:bf16:ws2:gather:s0: EXACT" in out
    assert out.count("full case") == 2 and out.count("time on NCCL (projected): case") == 2


def test_a_case_that_does_not_pass_fails_the_benchmark(capsys):
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", "mutant:nibble_swap", "--reps", "1",
                          "--formats", "nvfp4_2d"])
    out = capsys.readouterr().out
    assert rc == 1 and "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0: SILENT_MISMATCH" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU the benchmark runs on")
def test_without_a_gpu_it_skips_in_one_line(capsys):
    assert case_bench.main([]) == 0
    assert capsys.readouterr().out.strip().startswith("bench gpu: skipped: needs a CUDA GPU")


def test_every_goal_is_printed_and_a_missed_one_fails(capsys, monkeypatch):
    monkeypatch.setattr(case_bench, "TIME_GOAL", 1e-9)  # no case is within a billionth of its bare work
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", "reference", "--reps", "1",
                          "--formats", "fp8_tensor"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "MISSED time on NCCL (projected)" in out and "ok     verdict: EXACT" in out
    assert "bench gpu: 1 goal(s) missed: fp8_tensor time on NCCL (projected)" in out
    assert "collective" in out.split("steps (rank")[1]  # where the seconds went, step by step
