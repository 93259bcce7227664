"""The step clock on CUDA (qgather.instruments.device_clock): device work queued in a step is charged
to that step, though the host leaves it at once."""

import time

import pytest
import torch

from qgather.instruments.device_clock import CudaClock
from qgather.model.phases import Phase, PhaseTracker

pytestmark = pytest.mark.gpu


def _busy(device: torch.device, seconds: float) -> None:
    """Queues about `seconds` of device work (the host returns at once): torch.cuda._sleep spins a
    kernel for a number of cycles, timed once here."""
    cycles = 10_000_000
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize(device)
    per_cycle = (time.perf_counter() - start) / cycles
    torch.cuda._sleep(int(seconds / per_cycle))


def test_queued_work_is_charged_to_the_step_that_queued_it(cuda):
    phases = PhaseTracker(CudaClock(cuda))
    host_start = time.perf_counter()
    _busy(cuda, 0.2)  # build: queued, not waited for
    queued_in = time.perf_counter() - host_start
    phases.current = Phase.SHARD  # the shard does nothing on the device
    got = dict(phases.seconds())
    assert queued_in < 0.05  # the host did not wait for the device in the build
    assert got[Phase.BUILD.value] > 0.15  # yet the build's device time is the build's
    assert got[Phase.SHARD.value] < 0.05
    started = dict(phases.started())
    assert started[Phase.SHARD.value] - started[Phase.BUILD.value] > 0.15  # the shard began after it


def test_a_clock_marks_without_waiting(cuda):
    clock = CudaClock(cuda)
    _busy(cuda, 0.2)
    before = time.perf_counter()
    mark = clock.mark()
    assert time.perf_counter() - before < 0.05
    (done,) = clock.done_at([mark])
    assert done - before > 0.15
