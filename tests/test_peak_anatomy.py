"""`peak_anatomy`: the allocator history replayed to its peak, holders grouped by where allocated."""

from __future__ import annotations

from qgather.tools.bench.peak_anatomy import UNKNOWN, anatomy, where_allocated

OWN = {"filename": "/site/qgather/check/inspection.py", "line": 90, "name": "_judge"}
TORCH = {"filename": "/site/torch/_tensor.py", "line": 12, "name": "float"}
MAIN = {"filename": "/run/bench.py", "line": 3, "name": "main"}


def _alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size}


def test_the_allocations_alive_at_the_highest_total_are_listed():
    trace = [_alloc(1, 100, OWN), _alloc(2, 50, TORCH, OWN, MAIN), _free(1, 100),
             _alloc(3, 120, MAIN), _free(3, 120), _alloc(4, 10, OWN)]
    found = anatomy(trace, before=7)
    assert found.peak == 170 and found.before == 7  # blocks 2 and 3, not 1 and 2 (150)
    assert [(h.where, h.nbytes, h.count) for h in found.holders] == [
        ("run/bench.py:3 main", 120, 1), ("check/inspection.py:90 _judge <- torch/_tensor.py:12 float", 50, 1)]


def test_a_block_from_before_the_trace_counts_neither_alive_nor_freed():
    trace = [_free(9, 500), _alloc(1, 300, OWN), _alloc(2, 300, OWN)]
    found = anatomy(trace)
    assert found.peak == 600 and [(h.nbytes, h.count) for h in found.holders] == [(600, 2)]


def test_the_bench_instrumentation_is_never_where_a_tensor_was_made():
    from qgather.tools.bench import case_bench, memory_waypoints

    te = {"filename": "/te/storage/float8_blockwise_tensor_storage.py", "line": 89, "name": "forward"}
    for module in (memory_waypoints, case_bench):  # where the modules are, not where they once were
        assert where_allocated([te, {"filename": module.__file__, "line": 1, "name": "call"}, OWN]) == \
            "check/inspection.py:90 _judge <- storage/float8_blockwise_tensor_storage.py:89 forward"
    wrapper = {"filename": memory_waypoints.__file__, "line": 70, "name": "call"}
    assert where_allocated([te, wrapper, OWN]) == \
        "check/inspection.py:90 _judge <- storage/float8_blockwise_tensor_storage.py:89 forward"
    assert where_allocated([te, wrapper]) == "storage/float8_blockwise_tensor_storage.py:89 forward"


def test_where_allocated_names_the_own_frame_first():
    assert where_allocated([]) == UNKNOWN
    assert where_allocated([OWN, MAIN]) == "check/inspection.py:90 _judge"
    assert where_allocated([TORCH, MAIN]) == "torch/_tensor.py:12 float"


def test_the_table_says_the_rest_in_one_line():
    trace = [_alloc(i, 10 * (i + 1), {"filename": f"/x/f{i}.py", "line": i, "name": "g"}) for i in range(4)]
    table = anatomy(trace).table(10, "units", rows=2).splitlines()
    assert table[0].startswith("  what is allocated at the peak (10.00 units above the 0.00")
    assert table[1].split() == ["4.00", "x1", "x/f3.py:3", "g"] and table[-1].split() == ["3.00", "2", "more", "places"]
