"""qgather.tools.bench.memory_waypoints: peaks per wrapped step, nested calls folded into their callers, and the
wrapped functions restored afterwards (the allocator is emulated: the logic is the same on CUDA)."""

import types

import torch

from qgather.tools.bench import memory_waypoints


class FakeAllocator:
    def __init__(self):
        self.now = self.peak = 0

    def alloc(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)

    def free(self, n):
        self.now -= n


def test_nested_peaks_and_restore(monkeypatch):
    mem = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem.now)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(mem, "peak", mem.now))
    steps = types.SimpleNamespace(__name__="steps")

    def inner():
        mem.alloc(50)
        mem.free(50)

    def outer():
        mem.alloc(10)
        steps.inner()
        mem.alloc(20)
        mem.free(30)

    steps.inner, steps.outer = inner, outer
    with memory_waypoints.recording(torch.device("cpu"), [(steps, "inner"), (steps, "outer")]) as points:
        steps.outer()
    assert points.peaks == {"steps.inner": 60, "steps.outer": 60}
    assert steps.inner is inner and steps.outer is outer
    assert "1.20  steps.inner" in points.table(50, "units")


def test_inherited_methods_are_unwrapped_by_removal():
    class Base:
        def f(self):
            return 1

    class Child(Base):
        pass

    original = Base.f
    with memory_waypoints.recording(torch.device("cpu"), [(Child, "f")]):
        assert "f" in vars(Child)
    assert "f" not in vars(Child) and Base.f is original
