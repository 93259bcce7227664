"""The rank-pool runtime on its good paths: specs, contexts, results, reuse, FSDP2, and outcomes.

Case functions live at module level: the ranks import this module to unpickle them.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from qgather.runtime import (
    CaseOutcome,
    PoolSpec,
    PoolSpecError,
    RankError,
    RankPool,
    external_world,
    get_pool,
    is_reporting_rank,
    shutdown_pools,
)
from qgather.runtime import spec as spec_module
from qgather.runtime.external import ExternalPool
from qgather.runtime.outcome import where_blocked

GLOO2 = PoolSpec("gloo", 2, "cpu")
GLOO4 = PoolSpec("gloo", 4, "cpu")


@pytest.fixture(scope="module", autouse=True)
def _stop_pools_after_module():
    yield
    shutdown_pools(keep_helpers=True)  # the next module's pools fork from the same warm forkserver


# -- case functions (run on every rank) ---------------------------------------------------------


def gather_ranks(ctx):
    mine = torch.tensor([ctx.rank])
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, group=ctx.group)
    return [int(t) for t in gathered]


def describe_context(ctx):
    return {
        "rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
        "seed": ctx.seed, "case_id": ctx.case_id, "group_size": ctx.group.size(),
        "is_world": ctx.group == dist.group.WORLD, "pid": os.getpid(),
    }


def random_draw(ctx):
    return torch.rand(4)


def rank_environment(ctx, names):
    return {name: os.environ.get(name) for name in names}


def fsdp2_shard_and_unshard(ctx):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(16, 8)  # same init on every rank: the runtime seeded them alike
    reference = model.weight.detach().clone()
    fully_shard(model, mesh=ctx.mesh)
    local_rows = model.weight.to_local().shape[0]
    model.unshard()
    full = model.weight.detach().clone()
    model.reshard()
    return {"local_rows": local_rows, "matches": bool(torch.equal(full, reference)),
            "mesh_cached": ctx.mesh is ctx.mesh}


def view_of_big_tensor(ctx):
    return {"slice": torch.arange(1_000_000, dtype=torch.float32)[ctx.rank: ctx.rank + 2]}


def unpicklable_result(ctx):
    return lambda: None


# -- specs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, words", [
    (PoolSpec("gloo", 0, "cpu"), "world size must be >= 1"),
    (PoolSpec("gloo", -2, "cpu"), "world size must be >= 1"),
    (PoolSpec("gloo", "4", "cpu"), "world size must be an int"),
    (PoolSpec("mpi", 2, "cpu"), "unknown backend 'mpi'"),
    (PoolSpec("gloo", 2, "tpu"), "unknown device 'tpu'"),
    (PoolSpec("nccl", 2, "cpu"), "nccl needs device='cuda'"),
])
def test_bad_spec_is_one_clear_line(spec, words):
    with pytest.raises(PoolSpecError, match=words) as info:
        spec.validate()
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.fixture
def outside_xdist(monkeypatch):
    """GPU sharing between xdist workers is tested on its own; keep it out of the other GPU tests."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    return monkeypatch


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_cuda_spec_without_gpus_is_refused(outside_xdist, monkeypatch, backend):
    monkeypatch.setattr(spec_module, "_parent_gpu_names", lambda: [])
    with pytest.raises(PoolSpecError, match="needs a GPU, but none is visible"):
        PoolSpec(backend, 2, "cuda").validate()


def test_more_nccl_ranks_than_gpus_is_refused(outside_xdist, monkeypatch):
    monkeypatch.setattr(spec_module, "_parent_gpu_names", lambda: ["0", "1"])
    with pytest.raises(PoolSpecError, match="4 ranks but 2 visible GPU"):
        PoolSpec("nccl", 4, "cuda").validate()
    assert PoolSpec("gloo", 4, "cuda").validate()  # gloo shares GPUs between ranks


def test_get_pool_refuses_bad_spec_before_spawning():
    with pytest.raises(PoolSpecError):
        get_pool(PoolSpec("gloo", 0, "cpu"))


def test_every_xdist_worker_sees_every_gpu_and_a_pool_runs_on_its_lease(monkeypatch):
    monkeypatch.setattr(spec_module, "_parent_gpu_names", lambda: ["4", "5", "6", "7"])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")
    assert spec_module.visible_gpus() == ["4", "5", "6", "7"]  # pools lease theirs (runtime.gpu_lease)
    nccl = PoolSpec("nccl", 2, "cuda")
    assert spec_module.rank_env(nccl, 1, ("5", "7"))["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert spec_module.rank_env(PoolSpec("gloo", 8, "cuda"), 1)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_auto_spec_follows_the_gpus(outside_xdist, monkeypatch):
    monkeypatch.setattr(spec_module, "_parent_gpu_names", lambda: [])
    assert PoolSpec.auto(4) == PoolSpec("gloo", 4, "cpu")
    monkeypatch.setattr(spec_module, "_parent_gpu_names", lambda: ["0", "1"])
    assert PoolSpec.auto(2) == PoolSpec("nccl", 2, "cuda")
    assert PoolSpec.auto(8) == PoolSpec("gloo", 8, "cuda")


# -- running cases --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [GLOO2, GLOO4], ids=["ws2", "ws4"])
def test_every_rank_returns_its_result(spec):
    out = get_pool(spec).run(gather_ranks, case_id="gather")
    assert out.status == "ok", out.summary()
    assert out.results == [list(range(spec.world_size))] * spec.world_size
    assert out.errors == {} and out.stacks == {} and out.exit_codes == {}
    assert out.case_id == "gather" and out.duration_s > 0
    assert "ok on" in out.summary()


def test_context_describes_the_rank():
    out = get_pool(GLOO2).run(describe_context, case_id="ctx:1", seed=7)
    assert out.status == "ok", out.summary()
    for rank, info in enumerate(out.results):
        assert info["rank"] == rank
        assert (info["world_size"], info["backend"], info["device"]) == (2, "gloo", "cpu")
        assert (info["seed"], info["case_id"], info["group_size"], info["is_world"]) == (7, "ctx:1", 2, True)


def test_pool_is_warm_and_reused():
    pool = get_pool(GLOO2)
    assert get_pool(PoolSpec("gloo", 2, "cpu")) is pool
    assert get_pool(GLOO4) is not pool
    first = pool.run(describe_context)
    spawns = pool.spawn_count
    second = pool.run(describe_context)
    assert [r["pid"] for r in first.results] == [r["pid"] for r in second.results] == pool.pids
    assert pool.spawn_count == spawns


def test_seed_is_applied_on_every_rank():
    pool = get_pool(GLOO2)
    a = pool.run(random_draw, seed=5).results
    b = pool.run(random_draw, seed=5).results
    c = pool.run(random_draw, seed=6).results
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], b[0])
    assert not torch.equal(a[0], c[0])


def test_ranks_get_the_runtime_environment(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    monkeypatch.setenv("QGATHER_TEST_MARKER", "from-parent")
    pool = RankPool(PoolSpec("gloo", 1, "cpu"))  # the environment is taken when the ranks spawn
    names = ["NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "GLOO_SOCKET_IFNAME", "QGATHER_TEST_MARKER"]
    try:
        out = pool.run(rank_environment, names)
    finally:
        pool.shutdown()
    assert out.results[0] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                              "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                              "QGATHER_TEST_MARKER": "from-parent"}


def test_fsdp2_fully_shard_and_unshard_on_the_mesh():
    out = get_pool(GLOO4).run(fsdp2_shard_and_unshard, seed=3)
    assert out.status == "ok", out.summary()
    assert out.results == [{"local_rows": 2, "matches": True, "mesh_cached": True}] * 4


def test_tensor_results_come_back_compact():
    out = get_pool(GLOO2).run(view_of_big_tensor)
    assert out.status == "ok", out.summary()
    for rank, result in enumerate(out.results):
        assert result["slice"].tolist() == [rank, rank + 1]
        assert result["slice"].untyped_storage().nbytes() == 8


def test_unpicklable_result_is_that_ranks_error():
    pool = get_pool(GLOO2)
    pids = pool.run(describe_context).results
    out = pool.run(unpicklable_result)
    assert out.status == "error"
    assert sorted(out.errors) == [0, 1]
    assert "not picklable" in out.errors[0].message
    assert [r["pid"] for r in pool.run(describe_context).results] == [r["pid"] for r in pids]


@pytest.mark.parametrize("fn, words", [
    (lambda ctx: None, "cannot send case"),
    ("not callable", "fn must be a module-level function"),
])
def test_unsendable_case_is_one_line_type_error(fn, words):
    with pytest.raises(TypeError, match=words) as info:
        get_pool(GLOO2).run(fn)
    assert "\n" not in str(info.value)


def test_unpicklable_argument_is_one_line_type_error():
    with pytest.raises(TypeError, match="args picklable"):
        get_pool(GLOO2).run(gather_ranks, lambda: None)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_bad_timeout_is_refused(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        get_pool(GLOO2).run(gather_ranks, timeout=timeout)


# -- outcomes without processes -------------------------------------------------------------------

HANG_DUMP = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 4100 in barrier
  File "/x/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/work/main/tests/test_x.py", line 12 in skip_one
  File "/work/main/harness/qgather/runtime/rank.py", line 170 in run_case_on_rank
  File "/work/main/harness/qgather/runtime/rank.py", line 150 in _serve
"""


def test_where_blocked_names_the_collective():
    assert where_blocked(HANG_DUMP) == "waiting in a collective (barrier)"
    plain = HANG_DUMP.replace("/x/torch/distributed/", "/x/lib/")
    assert where_blocked(plain) == "in barrier (distributed_c10d.py:4100)"
    assert where_blocked("") == "not running the case"


def test_summaries_are_short_and_specific():
    error = RankError(3, "ValueError", "block size 16 does not divide 136\nmore", "Traceback ...")
    out = CaseOutcome("error", [None] * 4, errors={3: error}, stacks={r: HANG_DUMP for r in range(3)},
                      duration_s=0.5, case_id="c1", unfinished=(0, 1, 2))
    assert out.summary() == ("rank 3 raised ValueError: block size 16 does not divide 136 "
                             "(ranks 0,1,2 were waiting in a collective (barrier))")
    every = {r: RankError(r, "ValueError", "bad dtype") for r in range(2)}
    assert CaseOutcome("error", [None] * 2, errors=every).summary() == "every rank raised ValueError: bad dtype"
    hang = CaseOutcome("hang", [None] * 2, stacks={0: HANG_DUMP, 1: HANG_DUMP}, duration_s=5.0,
                       unfinished=(0, 1))
    assert hang.summary() == "HANG after 5.0 s: ranks 0,1 were waiting in a collective (barrier)"
    crash = CaseOutcome("crash", [None] * 2, exit_codes={1: -11})
    assert crash.summary() == "CRASH: rank 1 killed by SIGSEGV"
    assert CaseOutcome("crash", [None] * 2, exit_codes={0: 3}).summary() == "CRASH: rank 0 exited with code 3"


# -- external launcher detection ------------------------------------------------------------------

LAUNCHER_VARS = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                 "SLURM_NTASKS", "LOCAL_RANK"]


@pytest.mark.parametrize("env, world", [
    ({}, None),
    ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, (1, 4)),
    ({"RANK": "2", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}, (2, 4)),
    ({"RANK": "2", "WORLD_SIZE": "4"}, None),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, (3, 8)),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, None),
])
def test_external_world_is_detected_from_the_environment(monkeypatch, env, world):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert external_world() == world
    assert is_reporting_rank() == (world is None or world[0] == 0)


def test_external_world_size_is_fixed_by_the_launcher():
    with pytest.raises(PoolSpecError, match="external launcher: world size is fixed at 4 by torchrun"):
        ExternalPool(PoolSpec("gloo", 8, "cpu"), (0, 4))


ADAPTER_DUMP = """Thread 0x00007f0000000003 (most recent call first):
  File "/x/lib/python3.11/threading.py", line 320 in wait
  File "/x/lib/python3.11/threading.py", line 622 in wait
  File "/x/lib/python3.11/site-packages/my_adapter/handshake.py", line 40 in wait_for_peer
  File "/x/lib/python3.11/site-packages/my_adapter/param.py", line 12 in make_param

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 4100 in barrier
  File "/x/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 364 in foreach_all_gather
  File "/x/torch/utils/_contextlib.py", line 124 in decorate_context
  File "/x/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", line 300 in unshard
  File "/x/torch/nn/modules/module.py", line 1700 in _call_impl
  File "/x/lib/python3.11/site-packages/my_adapter/param.py", line 90 in forward_step
  File "/work/main/harness/qgather/runtime/rank.py", line 170 in run_case_on_rank
  File "/work/main/harness/qgather/runtime/rank.py", line 150 in _serve
  File "/x/lib/python3.11/multiprocessing/process.py", line 108 in run
"""


def test_hang_report_shows_innermost_frames_then_the_implementation_frame():
    from qgather.engine.evidence import STACK_FRAMES
    from qgather.engine.evidence import stack_lines as _stack_lines

    lines = _stack_lines({0: ADAPTER_DUMP})
    assert lines[0] == "rank 0 stack (innermost first):"
    assert lines[1] == "  barrier (torch/distributed/distributed_c10d.py:4100)"
    assert len(lines) == 1 + STACK_FRAMES + 1
    assert lines[-1] == "  ... implementation frame: forward_step (my_adapter/param.py:90)"
    assert not any("multiprocessing" in line or "_serve" in line for line in lines)


_CASE_THREAD = """Thread 0x00007f0000000001 (most recent call first):
  File "/work/main/harness/qgather/runtime/rank.py", line 281 in run_case_on_rank
  File "/work/main/harness/qgather/runtime/rank.py", line 249 in _serve
"""
_WHEREABOUTS_THREAD = """Current thread 0x00007f0000000004 (most recent call first):
  File "/x/lib/python3.11/traceback.py", line 332 in walk_stack
  File "/x/lib/python3.11/traceback.py", line 387 in extended_frame_gen
  File "/work/main/harness/qgather/runtime/whereabouts.py", line 121 in frames_of
"""


def test_a_crash_in_another_thread_is_named_beside_the_case_threads_stack():
    # seen in make run: rank 1 killed by SIGSEGV, the report showing only its case thread at rank.py:281
    from qgather.engine.evidence import stack_lines as _stack_lines

    fatal = "Fatal Python error: Segmentation fault\n\n"
    lines = _stack_lines({1: fatal + _WHEREABOUTS_THREAD + "\n" + _CASE_THREAD})
    assert lines[0] == "rank 1 stack (innermost first):"
    assert lines[1].startswith("  run_case_on_rank (") and lines[1].endswith("rank.py:281)")  # the case thread
    crashed = lines[-1].split(" <- ")
    assert crashed[0].startswith("  ... crashed (Segmentation fault) in another thread: walk_stack (")
    assert [part.split(" (")[0] for part in crashed[1:]] == ["extended_frame_gen", "frames_of"]
    native = _stack_lines({1: fatal + _CASE_THREAD})  # no thread current: faulthandler ran in a native thread
    assert native[-1].startswith("  ... crashed (Segmentation fault) in a thread without Python frames")
    in_case = _stack_lines({1: fatal + _CASE_THREAD.replace("Thread", "Current thread", 1)})
    assert not any("crashed" in line for line in in_case)
    assert not any("crashed" in line for line in _stack_lines({0: ADAPTER_DUMP}))  # SIGTERM's dump: no crash


def test_where_blocked_names_adapter_code_before_library_frames():
    spinning = HANG_DUMP.replace(
        '  File "/x/torch/distributed/distributed_c10d.py", line 4100 in barrier\n'
        '  File "/x/torch/distributed/c10d_logger.py", line 81 in wrapper\n',
        '  File "/x/lib/python3.11/threading.py", line 331 in wait\n')
    assert where_blocked(spinning) == "in skip_one (test_x.py:12)"


# -- launcher detection: SLURM's meeting point, default world sizes, placement ---------------------

def test_srun_tasks_meet_where_slurm_says():
    from qgather.runtime.launch import detect_launch

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
           "SLURM_NODEID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[07-09,12]"}
    launch = detect_launch(env)
    assert (launch.kind, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size, launch.node) \
        == ("slurm", 5, 8, 1, 4, "1")
    assert (launch.master_addr, launch.master_port) == ("gpu07", str(12000 + 123456 % 20000))
    assert detect_launch({**env, "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"}).master_addr == "10.0.0.7"
    assert detect_launch({**env, "MASTER_ADDR": "h", "MASTER_PORT": "7"}).master_port == "7"
    batch_shell = {k: v for k, v in env.items() if k != "SLURM_STEP_ID"}  # sbatch's own shell: not a task
    assert detect_launch(batch_shell) is None


def test_torchrun_numbering_is_read():
    from qgather.runtime.launch import detect_launch

    launch = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                            "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "x"})
    assert (launch.kind, launch.rank, launch.local_rank, launch.local_world_size, launch.node) == \
        ("torchrun", 3, 1, 2, "1")


def test_default_world_sizes_under_a_launcher():
    from qgather.runtime.launch import default_world_sizes

    assert default_world_sizes(1) == [1]
    assert default_world_sizes(4) == [1, 2, 4]
    assert default_world_sizes(6) == [1, 2, 4, 6]
    assert default_world_sizes(16) == [1, 2, 4, 8, 16]


def test_placement_within_and_across_nodes():
    from qgather.runtime.job import placement

    nodes = ["a", "a", "b", "b"]  # 2 nodes x 2 ranks
    assert placement(1, nodes, "x") == ((0,), "intra-node")
    assert placement(2, nodes, "x", "intra") == ((0, 1), "intra-node")
    assert placement(2, nodes, "x", "cross") == ((0, 2), "cross-node")
    assert placement(3, nodes, "x") == ((0, 1, 2), "cross-node")
    assert placement(4, nodes, "x") == ((0, 1, 2, 3), "cross-node")
    assert placement(4, ["a"] * 4, "x", "cross") == ((0, 1, 2, 3), "intra-node")
    mixed = {placement(2, nodes, f"case{i}")[1] for i in range(16)}
    assert mixed == {"intra-node", "cross-node"}
    assert placement(2, nodes, "case3") == placement(2, nodes, "case3")  # a case id always lands the same way
