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
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{fmt}:"))
        assert "full case" in line and "ratio" in line
    assert "reference:nvfp4_2d:128x64:bf16:ws2:gather:s0: EXACT" in out


def test_a_case_that_does_not_pass_fails_the_benchmark(capsys):
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", "mutant:nibble_swap", "--reps", "1",
                          "--formats", "nvfp4_2d"])
    out = capsys.readouterr().out
    assert rc == 1 and "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0: SILENT_MISMATCH" in out, out


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has the GPUs the benchmark needs")
def test_without_the_gpus_it_skips_in_one_line(capsys):
    assert case_bench.main([]) == 0
    assert capsys.readouterr().out.strip().startswith("bench gpu: skipped: needs 2 CUDA GPUs")
