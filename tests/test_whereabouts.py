"""A rank counts as waiting for a failed one only inside a collective of its case, as its whereabouts
thread reads the frames of the thread running the case."""

import json
import os
import subprocess
import sys
import threading

import pytest

from qgather.runtime.whereabouts import FRAMES, at_agreement, frames_of, in_collective

RACE_SCRIPT = os.path.join(os.path.dirname(__file__), "_frames_race.py")

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


def _parked_deep(depth: int, parked: threading.Event, leave: threading.Event) -> None:
    if depth:
        return _parked_deep(depth - 1, parked, leave)
    parked.set()
    leave.wait(30)


def test_frames_of_reads_another_threads_innermost_frames_oldest_first():
    parked, leave = threading.Event(), threading.Event()
    thread = threading.Thread(target=_parked_deep, args=(FRAMES, parked, leave), daemon=True)
    thread.start()
    try:
        assert parked.wait(30)
        frames = frames_of(thread.ident)
    finally:
        leave.set()
        thread.join(30)
    names = [frame.rsplit(" ", 1)[1] for frame in frames]
    assert len(frames) == FRAMES
    assert names[-2:] == ["wait", "wait"]  # Event.wait, then Condition.wait (threading.py), innermost last
    assert names[:-3] == ["_parked_deep"] * (FRAMES - 3)
    assert frames[-3].startswith(f"{__file__}:") and frames[-3].endswith(" _parked_deep")
    assert frames_of(None) == [] and frames_of(threading.get_ident() + 1) == []


def test_a_collection_inside_frames_of_that_lets_the_thread_move_on_does_not_crash_it():
    """Seen in `make run`: a rank killed by SIGSEGV in its whereabouts thread (PyFrame_GetBack, core
    dump). Read through frame objects, this interleaving fails every time on CPython 3.11.7: a SIGSEGV,
    or the dead frame's memory read as another object ("'function' object has no attribute 'f_lineno'")."""
    result = subprocess.run([sys.executable, RACE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    seen = json.loads(result.stdout.splitlines()[-1])
    if not seen["interrupted"]:
        pytest.skip(f"Python {sys.version.split()[0]} did not collect inside frames_of (3.12+ collects at "
                    "the eval loop's checks only): the interleaving cannot happen there")
    # the frames are where the observed thread is once the collection let it move on (the collection
    # starts before the dump: dump_stacks opens its file first), not where it was
    assert seen["frames"][-4:] == ["observed", "parked_after", "wait", "wait"], seen
