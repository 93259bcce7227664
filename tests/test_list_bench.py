"""`qgather bench list`: the listing commands' wall time against the 5 s goal (the benchmark itself is
run by hand or by `make bench`, never as a timed test)."""

from __future__ import annotations

from qgather.tools.bench import list_bench
from qgather.tools.bench.list_bench import Timing


def test_the_goal_is_judged_on_the_median_and_a_failed_command_misses_it():
    assert Timing(("list",), (1.0, 9.0, 2.0), 0, 51).met  # one slow run under load: the median is 2 s
    slow = Timing(("list", "--cases"), (5.5, 6.0, 1.0), 0, 3107)
    assert not slow.met
    assert slow.line() == "list --cases: 5.5 s median of 3 (1.0-6.0 s), 3107 lines; goal 5 s MISSED"
    failed = Timing(("list",), (0.2,), 4, 0)
    assert not failed.met and failed.line().endswith("0 lines, exit 4; goal 5 s MISSED")


def test_the_bench_times_both_listings_and_exits_1_when_one_misses(monkeypatch, capsys):
    times = {("list",): (1.0,), ("list", "--cases"): (7.0,)}
    monkeypatch.setattr(list_bench, "time_command", lambda argv, reps: Timing(tuple(argv), times[tuple(argv)], 0, 3))
    assert list_bench.main(["--reps", "1"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "list: 1.0 s median of 1 (1.0-1.0 s), 3 lines; goal 5 s met",
        "list --cases: 7.0 s median of 1 (7.0-7.0 s), 3 lines; goal 5 s MISSED",
    ]
    times[("list", "--cases")] = (2.0,)
    assert list_bench.main([]) == 0
