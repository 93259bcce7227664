"""`qgather bench gpu` measures a full case against the bare work it wraps; on a host without the GPUs
it asks for it says so in one line and exits 0 (so `qgather bench` runs everywhere)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from qgather.model.case import CaseSpec
from qgather.model.records import RankResult
from qgather.model.verdict import Verdict
from qgather.runtime import shutdown_pools
from qgather.tools.bench import bench_report, case_bench, case_profile, memory_waypoints

# One xdist worker runs the module's benchmarks (`make test` uses --dist loadgroup): they share one pool.
pytestmark = pytest.mark.xdist_group("case_bench")


@pytest.fixture(scope="module")
def one_pool():
    """The module's benchmarks run in one pool of ranks: case_bench.main shuts every pool and the forkserver
    down as the command ends, which here started a forkserver and a pool per test (seconds each, most of such
    a test's time). The pool then runs several benchmarks' cases one after the other, as one `bench gpu` of
    several formats does; the module's end shuts it down, the forkserver left warm for the next module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(case_bench, "shutdown_pools", lambda: None)
        yield
    shutdown_pools(keep_helpers=True)


@pytest.mark.usefixtures("one_pool")
def test_a_cpu_dry_run_prints_a_ratio_per_format(capsys):
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", "reference", "--reps", "1",
                          "--formats", "nvfp4_2d,fp8_tensor"])
    out = capsys.readouterr().out
    assert rc in (0, 1), out  # 1: the goal missed, which tiny CPU shapes may do
    for fmt in ("nvfp4_2d", "fp8_tensor"):
        assert f"{fmt}: reference:{fmt}:128x64:bf16:ws2:gather:s0: EXACT (2 of 2 runs EXACT)" in out
    assert out.count("time on NCCL (projected): case") == 2
    assert out.count("bare work, its slowest rank: ") == 2 and "no module build (reference has no route" in out
    assert out.count("in the measured runs, which find it kept for the same weight") == 2  # the golden reused
    steps = out.split("steps (run 1, the median")[1]
    assert "slowest rank" in steps and "wait before the collective" in steps and "reached the collective last" in steps


@pytest.mark.usefixtures("one_pool")
def test_the_bare_work_counts_the_librarys_own_module_build(capsys):
    impl = "tests._own_route_adapters:ConfiguredOwnRoute"
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", impl, "--reps", "1",
                          "--formats", "nvfp4_2d"])
    out = capsys.readouterr().out
    assert rc in (0, 1), out
    assert f"{impl}'s own sharded module build (make_sharded_module, what its users run)" in out, out


@pytest.mark.usefixtures("one_pool")
def test_a_case_that_does_not_pass_fails_the_benchmark(capsys):
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", "mutant:nibble_swap", "--reps", "1",
                          "--formats", "nvfp4_2d"])
    out = capsys.readouterr().out
    assert rc == 1 and "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0: SILENT_MISMATCH" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU the benchmark runs on")
def test_without_a_gpu_it_skips_in_one_line(capsys):
    assert case_bench.main([]) == 0
    assert capsys.readouterr().out.strip().startswith("bench gpu: skipped: needs a CUDA GPU")


@pytest.mark.usefixtures("one_pool")
def test_every_goal_is_printed_and_a_missed_one_fails(capsys, monkeypatch):
    monkeypatch.setattr(bench_report, "TIME_GOAL", 1e-9)  # no case is within a billionth of its bare work
    rc = case_bench.main(["--device", "cpu", "--shape", "128x64", "--impl", "reference", "--reps", "1",
                          "--formats", "fp8_tensor"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "MISSED time on NCCL (projected)" in out and "ok     verdict: EXACT" in out
    assert "the library's own steps alone" not in out  # over gloo the collective goes through the host
    assert "bench gpu: 1 goal(s) missed: fp8_tensor time on NCCL (projected)" in out
    assert "collective" in out.split("steps (run")[1]  # where the seconds went, step by step


def _gpu_results(golden_s, peak_steps=None):
    """Two ranks' records of one warm-up and one measured run, as measure_on_rank returns them from
    an H100 (0.47 GB bf16 weight, 0.24 GB gathered per rank); `peak_steps[rank][run]`: the step of
    each run's peak (none without)."""
    bare = bench_report.BareWork(quantize_s=1e-3, collective_s=2e-3, build_s=5e-3, own_quantizer=True)
    results = []
    for rank in (0, 1):
        seconds = {"golden": golden_s, "collective": 1e-3, "inspection": 1e-3}
        result = RankResult(rank, (), seconds=tuple(seconds.items()), started=(("golden", 0.0), ("collective", 1.0)))
        warm_up = {"full_s": 0.02, "result": result, "peak_bytes": 2 * 470_000_000 + rank}
        measured = {"full_s": 0.02, "result": result, "peak_bytes": 3 * 470_000_000 // 2}
        if peak_steps:
            warm_up["peak_step"], measured["peak_step"] = peak_steps[rank]
        results.append({"runs": [warm_up, measured], "bare": bare,
                        "weight_bytes": 470_000_000, "weight_bf16_bytes": 470_000_000,
                        "collective_bytes": 117_000_000, "device_name": "NVIDIA H100 80GB HBM3"})
    return results


def test_on_nccl_each_of_qgathers_own_steps_is_a_goal_against_its_floor(capsys, monkeypatch):
    monkeypatch.setattr(bench_report, "classify_results", lambda results: SimpleNamespace(verdict=Verdict.EXACT,
                                                                                          reason=""))
    args = case_bench._parse(["--device", "cuda", "--world-size", "2"])
    missed = bench_report.report("fp8_block", "te:fp8_block:8192x28672:bf16:ws2:gather:s0", _gpu_results(0.5e-3),
                                args, "nccl")
    out = capsys.readouterr().out
    assert missed == [], out
    assert "ok     time: case 20.00 ms (its slowest rank) vs bare 8.00 ms: ratio 2.50" in out
    assert "te's own sharded module build (make_sharded_module, what its users run) 5.00 ms" in out
    assert ("the library's own steps alone (sharded module, shard, pre-all-gather hook, collective, post-all-gather "
            "hook, library forward, reshard, wait on the library's steps): 1.00 ms on rank 0, ratio 0.12 to the bare "
            "work: the least the case can take were qgather's own steps free") in out
    own = next(line for line in out.splitlines() if "own steps within their HBM floors" in line)
    assert own.strip().startswith("ok     qgather's own steps within their HBM floors: golden ")
    assert "inspection " in own
    inspection = next(line for line in out.split("steps (run")[1].splitlines() if line.strip().startswith("inspection"))
    assert "judged: " in inspection and "x, the runs' median)" in inspection, inspection  # what the goal line judged
    assert "ok     memory: peak 2.00x the bf16 weight per rank, 470.0 MB within the goal's 1410.0 MB (every run, " \
           "warm-up included: the warm-up run 2.00x, the measured runs 1.50x)" in out
    missed = bench_report.report("fp8_block", "te:fp8_block:8192x28672:bf16:ws2:gather:s0", _gpu_results(0.2),
                                args, "nccl")
    out = capsys.readouterr().out
    assert missed == ["fp8_block golden within 5x its HBM floor", "fp8_block qgather's own steps within their HBM "
                      "floors"], out
    assert ("MISSED golden within 5x its HBM floor: 200.00 ms on its slowest rank (the median of the measured runs) "
            "vs floor") in out


def test_the_memory_goal_names_the_step_and_rank_of_the_highest_peak(capsys, monkeypatch):
    monkeypatch.setattr(bench_report, "classify_results", lambda results: SimpleNamespace(verdict=Verdict.EXACT,
                                                                                          reason=""))
    args = case_bench._parse(["--device", "cuda", "--world-size", "2"])
    case_id = "te:fp8_block:8192x28672:bf16:ws2:gather:s0"
    steps = [("golden", "shard"), ("sharded module", "collective")]  # rank 1's warm-up peaks highest
    bench_report.report("fp8_block", case_id, _gpu_results(0.5e-3, steps), args, "nccl")
    memory = next(line for line in capsys.readouterr().out.splitlines() if " memory: " in line)
    assert memory.strip() == ("ok     memory: peak 2.00x the bf16 weight per rank, 470.0 MB within the goal's "
                              "1410.0 MB (every run, warm-up included: the warm-up run 2.00x, the measured runs "
                              '1.50x) (goal: <= 3x); reached in the step "sharded module" (rank 1)'), memory
    bench_report.report("fp8_block", case_id, _gpu_results(0.5e-3), args, "nccl")
    memory = next(line for line in capsys.readouterr().out.splitlines() if " memory: " in line)
    assert memory.strip().endswith("(goal: <= 3x)"), memory


def test_a_peak_a_few_mb_over_the_goal_misses_it_and_says_by_how_much(capsys, monkeypatch):
    # fp8_block on 2 x H200: 2.5 weights of TE's, half a weight of golden, and a few small tensors
    monkeypatch.setattr(bench_report, "classify_results", lambda results: SimpleNamespace(verdict=Verdict.EXACT,
                                                                                          reason=""))
    args = case_bench._parse(["--device", "cuda", "--world-size", "2"])
    results = _gpu_results(0.5e-3, [("shard", "shard"), ("shard", "shard")])
    results[0]["runs"][1]["peak_bytes"] = 3 * 470_000_000 + 1_900_000
    missed = bench_report.report("fp8_block", "te:fp8_block:8192x28672:bf16:ws2:gather:s0", results, args, "nccl")
    memory = next(line for line in capsys.readouterr().out.splitlines() if " memory: " in line)
    assert "fp8_block memory" in missed
    assert memory.strip().startswith("MISSED memory: peak 3.00x the bf16 weight per rank, 1.9 MB over the goal's "
                                     "1410.0 MB (every run, warm-up included: the warm-up run 2.00x, the measured "
                                     "runs 3.00x)"), memory


def test_a_runs_peak_step_is_the_step_with_the_highest_mark():
    result = RankResult(0, (), high_water=(("build/quantize", 10), ("golden", 50), ("shard", 40)))
    assert case_bench._peak_step(result) == "golden"
    assert case_bench._peak_step(RankResult(0, ())) is None


def test_the_profile_says_each_steps_host_time_in_a_range_of_its_own():
    owner = SimpleNamespace(__name__="steps", work=lambda n: torch.ones(n).sum())
    with profile(activities=[ProfilerActivity.CPU]) as prof, case_profile._ranges([(owner, "work")]):
        owner.work(8)
        owner.work(16)
    table = case_profile._range_table(prof.key_averages())
    assert table.splitlines()[1].split()[0] == "steps.work" and table.splitlines()[1].split()[-1] == "2", table
    assert owner.work(4) == 4 and not hasattr(owner.work, "__wrapped__")  # the original is back


@pytest.mark.parametrize("case_id", ["reference:nvfp4_2d:256x512:bf16:ws2:gather:s0",
                                     "te:fp8_block:8192x28672:bf16:ws2:gather:s0"])
def test_every_step_the_profile_wraps_exists(case_id):
    """--profile wraps the case's step functions by name (private ones among them): a renamed one
    would fail only there, on a GPU host."""
    targets = case_profile._step_targets(CaseSpec.parse(case_id))
    assert len(targets) > 15
    with memory_waypoints.wrapping(targets, lambda label, fn: fn):
        pass



@pytest.mark.usefixtures("one_pool")
def test_the_park_probe_measures_each_mode_as_the_bench_measures_a_run():
    """park_probe's modes run through case_bench.measured_runs: each run's seconds, result and peak."""
    from qgather.runtime import PoolSpec, get_pool
    from qgather.tools.bench import park_probe

    pool = get_pool(PoolSpec(backend="gloo", world_size=2, device="cpu"))
    case_id = "reference:fp8_tensor:128x64:bf16:ws2:gather:s0"
    for mode in park_probe.MODES:
        outcome = pool.run(park_probe.probe_on_rank, case_id, 1, mode, timeout=120.0)
        assert outcome.status == "ok", outcome.summary()
        line = park_probe._summary(mode, outcome.results)
        assert line.startswith(f"  {mode:6s} verdicts EXACT,EXACT; peak ") and "the median run's slowest rank: " in line
