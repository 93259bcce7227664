"""A rank counts as waiting for a failed one only inside a collective of its case."""

from qgather.runtime.whereabouts import at_agreement, in_collective

C10D = "/x/torch/distributed/distributed_c10d.py:4000 all_reduce"


def test_a_collective_of_the_case_is_waiting():
    frames = ["/x/qgather/runtime/rank.py:200 run_case_on_rank", "/x/qgather/scenarios/core.py:150 _run_on_rank", C10D]
    assert in_collective(frames) == "distributed_c10d.py:4000 all_reduce"


def test_the_ranks_own_barrier_before_the_case_is_not():
    frames = ["/x/qgather/runtime/rank.py:195 run_case_on_rank", "/x/qgather/runtime/rank.py:88 barrier", C10D]
    assert in_collective(frames) is None


def test_adapter_code_is_not():
    assert in_collective(["/x/mylib/tensor.py:10 fsdp_pre_all_gather", "/usr/lib/threading.py:300 wait"]) is None


def test_a_library_call_that_waits_in_native_code_counts_as_a_collective():
    # seen on an H100: TE's current-scaling quantize all-reduces the amax from C++ (no c10d frame)
    frames = ["/x/qgather/scenarios/fsdp.py:80 run_fsdp",
              "/site/transformer_engine/pytorch/tensor/float8_tensor.py:316 quantize_impl"]
    assert in_collective(frames) == "float8_tensor.py:316 quantize_impl"
    # only while the rank is in that call itself: a Python frame below it is not the native wait
    assert in_collective(frames + ["/site/transformer_engine/pytorch/utils.py:10 helper"]) is None


def test_a_cuda_synchronize_waits_for_the_collective_kernels_queued_before_it():
    # seen on 4 H100s: on NCCL a rank whose peer raised before the all-gather waits in synchronize
    frames = ["/x/qgather/scenarios/fsdp.py:80 run_fsdp", "/site/torch/cuda/__init__.py:1162 synchronize"]
    assert in_collective(frames) == "__init__.py:1162 synchronize"
    assert in_collective(["/site/torch/cuda/__init__.py:400 current_device"]) is None


def test_a_held_collectives_wait_counts_as_a_collective_though_no_torch_frame_shows():
    # a pair's collective held among its members polls the store's keys: agreement.py's own frames only
    frames = ["/x/cases/mine.py:12 pair_case", "/x/qgather/runtime/agreement.py:170 held",
              "/x/qgather/runtime/agreement.py:230 _agree", "/x/qgather/runtime/agreement.py:290 _wait_for_members"]
    assert at_agreement(frames)
    assert in_collective(frames) == "agreement.py:290 _wait_for_members"
    assert not at_agreement(frames[:-1]) and in_collective(frames[:-1]) is None
