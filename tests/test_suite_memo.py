"""qgather.suite.memo: the generated cases kept between processes, under a key of everything they are
computed from (the package's and the suite's modules, Python's and torch's versions, the call)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qgather.model.case import CaseSpec
from qgather.suite import memo


class CountingSweep:
    """A sweep whose cases say how often they were computed."""

    def __init__(self) -> None:
        self.calls = 0

    def cases(self, impls, formats=None, **_):
        self.calls += 1
        formats = formats or ("fp8_tensor",)
        return [CaseSpec(impl, fmt, (32, 64), "bf16", 2, "gather") for impl in impls for fmt in formats]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(memo.CACHE_ENV, str(tmp_path / "memo"))
    _new_process()
    yield tmp_path / "memo"
    _new_process()


def _new_process() -> None:
    """Forget what this process knows of the memo, as a new process would."""
    memo._memo_path.cache_clear()
    memo._entries.cache_clear()


def test_a_second_call_is_served_from_the_memo_with_the_same_cases(cache):
    sweep = CountingSweep()
    first = memo.cases("test_x", sweep, ["reference"], formats=["nvfp4_2d"], world_sizes=None)
    _new_process()  # the memo is read back from its file
    again = memo.cases("test_x", sweep, ["reference"], formats=["nvfp4_2d"], world_sizes=None)
    assert sweep.calls == 1 and again == first
    assert [c.id for c in first] == ["reference:nvfp4_2d:32x64:bf16:ws2:gather:s0"]
    assert len(list(cache.glob("cases-*.pickle"))) == 1


def test_another_call_or_module_is_another_entry(cache):
    sweep = CountingSweep()
    memo.cases("test_x", sweep, ["reference"], formats=["nvfp4_2d"])
    other_format = memo.cases("test_x", sweep, ["reference"], formats=["mxfp8"])
    memo.cases("test_y", sweep, ["reference"], formats=["nvfp4_2d"])
    memo.cases("test_x", sweep, ["torchao"], formats=["nvfp4_2d"])
    assert sweep.calls == 4 and other_format[0].fmt == "mxfp8"


def test_an_edited_module_is_a_new_key(tmp_path, monkeypatch):
    package = tmp_path / "qgather"
    shutil.copytree(memo.PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(memo, "PACKAGE_DIR", str(package))
    monkeypatch.setattr(memo, "suite_dir", lambda: str(package / "cases"))
    before = memo.source_digest()
    assert memo.source_digest() == before  # deterministic
    sweeps = package / "suite" / "sweeps.py"
    sweeps.write_text(sweeps.read_text() + "\n# an edit\n")
    assert memo.source_digest() != before


def test_off_or_a_format_plugin_computes_every_time(cache, monkeypatch):
    sweep = CountingSweep()
    monkeypatch.setenv(memo.CACHE_ENV, memo.OFF)
    _new_process()
    memo.cases("test_x", sweep, ["reference"])
    memo.cases("test_x", sweep, ["reference"])
    assert sweep.calls == 2 and not cache.exists()
    monkeypatch.setenv(memo.CACHE_ENV, str(cache))
    monkeypatch.setattr(memo, "entry_points", lambda group: ["a plugin's format"] if group == "qgather.formats" else [])
    _new_process()
    memo.cases("test_x", sweep, ["reference"])
    assert sweep.calls == 3 and not cache.exists()  # a plugin's code is outside the key: no memo


def test_an_unreadable_or_unwritable_memo_is_computed_instead(cache, monkeypatch):
    sweep = CountingSweep()
    memo.cases("test_x", sweep, ["reference"])
    (path,) = cache.glob("cases-*.pickle")
    path.write_bytes(b"not a pickle")
    _new_process()
    assert memo.cases("test_x", sweep, ["reference"])[0].impl == "reference" and sweep.calls == 2
    blocked = cache / "a file"
    blocked.write_text("")
    monkeypatch.setenv(memo.CACHE_ENV, str(blocked / "memo"))  # below a file: not even root can create it
    _new_process()
    assert memo.cases("test_x", sweep, ["torchao"])[0].impl == "torchao" and sweep.calls == 3
    assert not list(cache.glob(".tmp-*"))


def test_a_pass_over_many_sweeps_writes_the_memo_once(cache, monkeypatch):
    writes, store = [], memo._store
    monkeypatch.setattr(memo, "_store", lambda path, entries: writes.append(len(entries)) or store(path, entries))
    sweep, kept = CountingSweep(), memo.Memo()
    for module in ("test_x", "test_y", "test_z"):
        kept.cases(module, sweep, ["reference"], formats=["nvfp4_2d"])
    assert writes == []
    kept.flush()
    kept.flush()  # nothing new: nothing written
    assert writes == [3]
    _new_process()
    again = memo.Memo()
    for module in ("test_x", "test_y", "test_z"):
        again.cases(module, sweep, ["reference"], formats=["nvfp4_2d"])
    again.flush()
    assert sweep.calls == 3 and writes == [3]  # all served from the file: no second write


def test_a_value_is_computed_once_per_source_and_key(cache):
    calls = []

    def compute():
        calls.append(1)
        return frozenset({("a", 1)})

    kept = memo.Memo()
    first = kept.value("pairs of x", compute)
    kept.flush()
    _new_process()
    again = memo.Memo()
    assert again.value("pairs of x", compute) == first and len(calls) == 1
    assert again.value("pairs of y", compute) == first and len(calls) == 2  # another key: computed


def test_a_runs_coverage_takes_the_designs_pairs_from_the_memo_with_the_same_result(cache):
    from qgather.suite import config_coverage, config_space

    cases = [CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s0:compile+dcp-ws1")]
    kept = memo.Memo()
    computed = config_coverage.measure(cases, memo=kept)
    kept.flush()
    assert any(key.startswith("value ('impossible'") for key in kept.entries)
    _new_process()
    config_space.impossible.cache_clear()
    served = config_coverage.measure(cases, memo=memo.Memo())
    assert served == computed and served.impossible
