"""The step clock on CUDA (qgather.instruments.device_clock): device work queued in a step is charged
to that step, though the host leaves it at once.

The device work is torch.cuda._sleep's spinning kernel, a fixed number of cycles: at least ~0.1 s on
an H100/H200 (under 2 GHz), longer on a GPU that other processes share, never shorter."""

import time

import pytest
import torch

from qgather.instruments.device_clock import CudaClock
from qgather.model.phases import Phase, PhaseTracker

pytestmark = pytest.mark.gpu

SPIN_CYCLES = 200_000_000


@pytest.fixture(autouse=True)
def spin_kernel_loaded(cuda):
    """Loads the spin kernel (CUDA loads modules lazily) so that queueing it is a launch, not a load."""
    torch.cuda._sleep(1)
    torch.cuda.synchronize(cuda)


def test_queued_work_is_charged_to_the_step_that_queued_it(cuda):
    phases = PhaseTracker(CudaClock(cuda))
    start = time.perf_counter()
    torch.cuda._sleep(SPIN_CYCLES)  # build: queued, not waited for
    queued_in = time.perf_counter() - start
    phases.current = Phase.SHARD
    torch.cuda.synchronize(cuda)  # the shard waits for the build's work: the wait is the build's
    waited = time.perf_counter() - start
    got = dict(phases.seconds())
    build, shard = got[Phase.BUILD.value], got[Phase.SHARD.value]
    # The host left the build well before its work ended (a launch can take tens of ms on a shared GPU):
    assert waited > 0.05 and queued_in < waited / 2
    assert build > 0.9 * waited and shard < 0.1 * waited  # a host-only clock: build = queued_in < waited / 2
    assert build + shard == pytest.approx(waited, abs=0.01)  # the steps still sum to the case's time
    started = dict(phases.started())
    assert started[Phase.SHARD.value] - started[Phase.BUILD.value] == pytest.approx(build, abs=0.01)


def test_a_clock_marks_without_waiting(cuda):
    clock = CudaClock(cuda)
    torch.cuda._sleep(SPIN_CYCLES)
    before = time.perf_counter()
    mark = clock.mark()
    marked_in = time.perf_counter() - before
    (done,) = clock.done_at([mark])
    assert done - before > 0.05 and marked_in < (done - before) / 2
