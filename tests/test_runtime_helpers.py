"""The forkserver's socket below a deep TMPDIR (qgather.runtime.helpers.fit_socket_path): a Unix
socket's path holds at most 107 bytes, and a runner under pytest-xdist's tmp_path fell back to
spawn without a word (slower ranks, and a SIGKILLed runner's pool dir left behind). The end to end
check is tests/test_runtime_lifeline.py, which asserts the forkserver runs and its socket dir goes."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import warnings

import pytest

from qgather.runtime import helpers


@pytest.fixture
def mp_config(monkeypatch):
    """multiprocessing without a temp dir of its own, restored afterwards (a dir made meanwhile is
    removed at exit by the finalizer fit_socket_path registers, as multiprocessing's own is)."""
    config = mp.current_process()._config
    monkeypatch.setitem(config, "tempdir", None)
    return config


def test_a_deep_tmpdir_gets_a_short_socket_dir(mp_config, monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = helpers.fit_socket_path()
    assert made is not None and mp_config["tempdir"] == made and os.path.isdir(made)
    assert os.path.dirname(made) in helpers.SHORT_TEMP_BASES
    assert len(made) + len("/listener-12345678") <= helpers.SOCKET_PATH_MAX


def test_a_short_tmpdir_and_an_existing_temp_dir_are_left_alone(mp_config, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert helpers.fit_socket_path() is None and mp_config["tempdir"] is None
    mp_config["tempdir"] = "/somewhere/already"
    monkeypatch.setattr(tempfile, "tempdir", "/" + "x" * 100)
    assert helpers.fit_socket_path() is None and mp_config["tempdir"] == "/somewhere/already"


def test_a_forkserver_that_cannot_start_is_said(monkeypatch):
    def refuse():
        raise OSError("AF_UNIX path too long")

    monkeypatch.setattr(helpers, "_helper_pid", lambda name: None)
    monkeypatch.setattr(helpers.forkserver._forkserver, "ensure_running", refuse)
    monkeypatch.setattr(helpers, "fit_socket_path", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert helpers._forkserver_context() is None
    assert [str(w.message) for w in caught] == [
        "qgather: the forkserver did not start (OSError: AF_UNIX path too long); ranks start with spawn: slower, "
        "and a runner killed by SIGKILL leaves its pool dir to the next run's sweep"]


def test_a_run_with_compiled_cases_has_the_forkserver_warm_torch_compile_up(monkeypatch):
    """preload_compile_warmup adds the warm-up module to the forkserver's preload once, after what
    the environment already names (e.g. TE on a GPU host), and the run's end restores the variable;
    on a CPU build of torch the warm-up compiles."""
    monkeypatch.setenv(helpers.PRELOAD_ENV, "json")
    assert helpers.preload_compile_warmup() == "json"
    assert helpers.preload_compile_warmup() == f"json,{helpers.COMPILE_WARMUP}"
    assert os.environ[helpers.PRELOAD_ENV] == f"json,{helpers.COMPILE_WARMUP}"
    assert helpers.forkserver_preload()[-2:] == ["json", helpers.COMPILE_WARMUP]
    helpers.restore_preload("json")
    assert os.environ[helpers.PRELOAD_ENV] == "json"
    monkeypatch.delenv(helpers.PRELOAD_ENV)
    helpers.restore_preload(helpers.preload_compile_warmup())
    assert helpers.PRELOAD_ENV not in os.environ
    from qgather.runtime import compile_warmup

    torch = __import__("torch")
    assert compile_warmup.warm_up() is (torch.version.cuda is None and getattr(torch.version, "hip", None) is None)


def test_a_cpu_run_has_its_forkserver_import_the_scenarios_and_its_libraries_once(monkeypatch):
    """qgather.pytest_plugin.collection.rank_preloads: on a CPU build the forkserver imports the case
    functions' module and what the run's implementations import on use (torchao's float8 API, through a
    module that leaves a failing torchao to the cases), compiled cases add the warm-up; nothing to
    preload without cases, and only the warm-up on a CUDA build."""
    import sys
    from types import SimpleNamespace

    import pytest
    import torch

    from qgather.model.case import CaseSpec
    from qgather.pytest_plugin import collection

    def preloads(sweeps, companions=()):
        stash = pytest.Stash()
        stash[collection.sweep_sizes_key] = [[CaseSpec.parse(c) for c in cases] for cases in sweeps]
        stash[collection.companion_cases_key] = [CaseSpec.parse(c) for c in companions]
        return collection.rank_preloads(SimpleNamespace(stash=stash))

    plain = "reference:fp8_tensor:128x64:bf16:ws2:gather:s0"
    compiled = f"{plain}:compile"
    torchao = "torchao:fp8_tensor:128x64:bf16:ws2:gather:s0"
    assert preloads([]) == []
    assert preloads([[plain]]) == [collection.SCENARIOS_MODULE]
    assert preloads([[compiled], []], [torchao]) == [helpers.COMPILE_WARMUP, collection.SCENARIOS_MODULE,
                                                     "qgather.impls.torchao.rank_import"]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert preloads([[compiled]], [torchao]) == [helpers.COMPILE_WARMUP]
    monkeypatch.setitem(sys.modules, "torchao", None)  # a torchao that does not import
    monkeypatch.delitem(sys.modules, "qgather.impls.torchao.rank_import", raising=False)
    __import__("qgather.impls.torchao.rank_import")  # leaves it to the cases: no error here


def test_preload_for_run_adds_each_module_once_after_the_environments(monkeypatch):
    monkeypatch.setenv(helpers.PRELOAD_ENV, "json")
    assert helpers.preload_for_run(["a.b", "json"]) == "json"
    assert helpers.preload_for_run(["a.b", "c"]) == "json,a.b"
    assert os.environ[helpers.PRELOAD_ENV] == "json,a.b,c"
