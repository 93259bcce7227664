"""Bad input gets one clear stderr line and a non-zero exit, never a traceback or a green run of nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests._one_process import qgather_mains

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "golden")
CASE = "reference:nvfp4_2d:64x64:bf16:ws2:gather:s0"


def qgather(*args: str, cwd: str | None = None, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, pythonpath) if p)
    return subprocess.run([sys.executable, "-m", "qgather", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, env=env, timeout=300)


def assert_one_line(result: subprocess.CompletedProcess, rc: int, *words: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == rc, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def _write_adapters(folder) -> str:
    (folder / "bad_syntax.py").write_text("def broken(:\n")
    (folder / "bad_import.py").write_text("raise RuntimeError('adapter exploded at import')\n")
    (folder / "bad_ctor.py").write_text(
        "from qgather.impls.reference import ReferenceImplementation\n"
        "class Adapter(ReferenceImplementation):\n"
        "    def __init__(self):\n"
        "        raise ValueError('constructor exploded')\n")
    return str(folder)


# Each breakage through `case`, and `run` through one of them: both commands load the adapter with
# qgather.impls.get_impl, which words each breakage (the run x breakage product once spent two more processes).
BROKEN = [("case", "bad_syntax:Adapter", "SyntaxError"),
          ("case", "bad_import:Adapter", "adapter exploded at import"),
          ("case", "bad_ctor:Adapter", "constructor exploded"),
          ("run", "bad_ctor:Adapter", "constructor exploded")]


def _broken_argv(command: str, target: str) -> list[str]:
    if command == "run":
        return ["run", "--impl", target, "-q", "--formats", "nvfp4_2d"]
    return ["case", CASE.replace("reference", target, 1)]


@pytest.fixture(scope="module")
def broken_adapter_results(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """The four commands' results, made in one process of its own (one torch import, where each once spent its
    own): each command refuses its adapter before any case runs, so none leaves state the next one meets."""
    adapters = _write_adapters(tmp_path_factory.mktemp("adapters"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, adapters])}
    argvs = [_broken_argv(command, target) for command, target, _ in BROKEN]
    results = qgather_mains(argvs, cwd=REPO, env=env)
    return {(command, target): subprocess.CompletedProcess(argv, rc, out, err)
            for (command, target, _), argv, (rc, out, err) in zip(BROKEN, argvs, results, strict=True)}


@pytest.mark.xdist_group("broken_adapters")  # one worker makes the fixture's process
@pytest.mark.parametrize("command,target,why", BROKEN)
def test_broken_adapter(broken_adapter_results, target, why, command):
    assert_one_line(broken_adapter_results[command, target], 4, target, why)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
@pytest.mark.parametrize("command", ["run", "case", "virtual"])
def test_bad_case_timeout(command, value):
    if command == "run":
        result = qgather("run", f"--case-timeout={value}", "-q")
    elif command == "case":
        result = qgather("case", CASE, f"--case-timeout={value}")
    else:
        result = qgather("case", "reference:nvfp4_2d:64x64:bf16:ws8:virtual:s0", f"--case-timeout={value}")
    assert_one_line(result, 4, "--case-timeout")


# Under xdist (-n 2) the plugin's own check cannot stop the session: `qgather run` refuses before pytest starts.
# Without -n, and under plain pytest, an empty selection is one code path with test_cli_ux's
# test_a_selection_without_cases_is_a_usage_error (run and pytest), which checks it.
def test_world_sizes_without_cases():
    result = qgather("run", "--world-sizes", "5", "-q", "--formats", "nvfp4_2d", "-n", "2")
    assert_one_line(result, 4, "--world-sizes 5")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a host without a GPU")
@pytest.mark.parametrize("option", [["--device", "cuda"], ["--backend", "nccl"]])
@pytest.mark.parametrize("command", ["run", "case"])
def test_gpu_asked_without_gpu(command, option):
    args = ["run", *option, "-q"] if command == "run" else ["case", CASE, *option]
    assert_one_line(qgather(*args), 4, option[0], "no CUDA GPU")


def test_selftest_usage_error_exits_4():
    assert qgather("selftest", "--no-such-option").returncode == 4


# The golden check: every bad entry reported, the rest still checked, exit 1.

def _corpus(tmp_path) -> str:
    target = str(tmp_path / "golden")
    shutil.copytree(GOLDEN, target)
    return target


def _manifest(corpus: str) -> dict:
    with open(os.path.join(corpus, "manifest.json")) as fh:
        return json.load(fh)


def _write(corpus: str, manifest: dict) -> None:
    with open(os.path.join(corpus, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)


def test_golden_bad_entries_each_reported(tmp_path):
    corpus = _corpus(tmp_path)
    manifest = _manifest(corpus)
    entries = manifest["entries"]
    del entries[0]["sha256"]
    entries[1]["format"] = "fp3_nonsense"
    os.remove(os.path.join(corpus, entries[2]["file"]))
    path = os.path.join(corpus, entries[3]["file"])
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data[: len(data) // 2])
    manifest["entries"] = entries[:5]
    _write(corpus, manifest)
    result = qgather("golden", "--check", "--dir", corpus)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    out = result.stdout
    assert "lacks sha256" in out and "unknown format 'fp3_nonsense'" in out and "file missing" in out
    assert f"{entries[3]['file']}: cannot check" in out
    assert "golden: 5 entries, 4 problems" in out


@pytest.mark.parametrize("content,why", [
    (None, "no manifest"),
    ('{"entries": [', "not valid JSON"),
    ('{"entries": []}', "no entries"),
])
def test_golden_bad_manifest(tmp_path, capsys, content, why):
    """Through the command line's main in this process: the check's reading of a manifest does not depend on
    a fresh process (the exit status and no traceback of a real one: test_golden_bad_entries_each_reported)."""
    from qgather.cli import main

    corpus = _corpus(tmp_path)
    path = os.path.join(corpus, "manifest.json")
    if content is None:
        os.remove(path)
    else:
        with open(path, "w") as fh:
            fh.write(content)
    rc = main(["golden", "--check", "--dir", corpus])
    out, err = capsys.readouterr()
    assert_one_line(subprocess.CompletedProcess(["qgather", "golden"], rc, out, err), 1, "manifest.json", why)


def test_help_and_a_bad_option_start_no_torch():
    """`qgather --help` and an option refused by its syntax answer before torch is imported."""
    code = ("import sys; from qgather.cli import main; "
            f"rcs = [main(['--help']), main(['case', {CASE!r}, '--case-timeout', '0']), "
            "main(['run', '--case-timeout=nan'])]; print(rcs, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.stdout.strip().splitlines()[-1] == "[0, 4, 4] False", result.stdout + result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 2, result.stderr


BAD_NAMES = [["run", "--formats", "fp7"], ["run", "--scenarios", "explode"], ["run", "--impl", "nosuch"],
             ["list", "--cases", "--impl", "nosuch"], ["coverage", "--formats", "fp7"],
             ["run", "--formats", "fp8_tensor", "--world-sizes", "2", "--impl", "reference,nosuch"],
             ["case", "nonsense:id"], ["repro", "reference:nvfp4_2d:136x64:bf99:ws2:gather:s0"],
             ["baseline", "update", "--from", "/nonexistent/verdicts.json"]]
# argparse's own refusals (its usage line, then the error) of the commands whose modules import torch
BAD_SYNTAX = [["selftest", "--bogus"], ["golden", "--producer", "nobody"], ["sweep", "--impl", "reference"],
              ["sweep", "--impl", "nosuch", "--format", "nvfp4_2d"],
              ["sweep", "--impl", "reference", "--format", "fp7"], ["baseline", "update"]]


def test_a_bad_name_is_refused_before_torch_is_imported():
    """Bad input is answered in well under a second on a loaded host: before torch is imported (checked
    deterministically in the process, rather than timed)."""
    code = ("import sys; from qgather.cli import main; "
            f"rcs = [main(argv) for argv in {BAD_NAMES!r}]; print(rcs, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.stdout.strip().splitlines()[-1] == f"{[4] * len(BAD_NAMES)} False", result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == len(BAD_NAMES) and all(len(line) < 300 for line in lines), lines


def _run_refusals() -> list[list[str]]:
    """`qgather run`'s inputs that are checked before torch loads (a GPU only where none is visible)."""
    from qgather.suite.options import _no_gpu_visible

    gpu = [["run", "--device", "cuda"], ["run", "--backend", "nccl"]] if _no_gpu_visible() else []
    return [["run", "--baseline", "/nonexistent/known-issues.toml"],
            ["run", "--baseline", os.path.join(REPO, "README.md")],
            ["run", "--report-dir", "/proc/qgather-x"], ["run", "--junitxml", "/proc/x.xml"],
            ["run", "--qgather-json", "/proc/x.json"], ["run", "--impl", "nosuchpkg.adapters:Impl"],
            ["case", "nosuchpkg.adapters:Impl:fp8_tensor:128x64:bf16:ws2:gather:s0"],
            ["run", "--formats", "nosuchpkg.format:Fmt"], *gpu]


def test_a_runs_files_gpu_and_adapter_are_refused_before_torch_is_imported(tmp_path):
    """A bad --baseline, an output that cannot be written, a GPU on a host without one, an adapter or a format
    of one's own that cannot be imported from here: one line `qgather <command>: <the option or case as
    typed>: why`, exit 4, before torch loads (well under a second on a loaded host; checked in the process,
    not timed)."""
    argvs = _run_refusals()
    code = ("import sys; from qgather.cli import main; "
            f"rcs = [main(argv) for argv in {argvs!r}]; print(rcs, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO}, cwd=tmp_path)
    assert result.stdout.strip().splitlines()[-1] == f"{[4] * len(argvs)} False", result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == len(argvs), lines
    for argv, line in zip(argvs, lines):
        typed = argv[1] if argv[0] == "case" else argv[2] if argv[1] in ("--impl", "--formats") else " ".join(argv[1:])
        assert line.startswith(f"qgather {argv[0]}: ") and typed in line and argv[1] in line, (argv, line)
    assert "--impl" not in lines[6], lines  # a case id names no option


def test_a_commands_own_syntax_is_checked_before_torch_is_imported():
    """selftest, golden, sweep and baseline read their arguments with parsers that import nothing heavy."""
    code = ("import sys; from qgather.cli import main; "
            f"rcs = [main(argv) for argv in {BAD_SYNTAX!r}]; print(rcs, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert result.stdout.strip().splitlines()[-1] == f"{[4] * len(BAD_SYNTAX)} False", result.stdout + result.stderr


def test_the_name_lists_agree_with_the_registries():
    from qgather.formats import FORMATS
    from qgather.impls import _builtin
    from qgather.model.names import BUILTIN_IMPLS, FORMAT_NAMES

    assert tuple(FORMATS)[: len(FORMAT_NAMES)] == FORMAT_NAMES
    assert sorted(n for n in _builtin() if not n.startswith("mutant:")) == sorted(BUILTIN_IMPLS)


def test_the_qgather_script_runs_the_same_main():
    script = os.path.join(os.path.dirname(sys.executable), "qgather")
    if not os.path.exists(script):
        pytest.skip("no qgather script next to this Python (not an installed environment)")
    result = subprocess.run([script, "list", "scenarios"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "  gather" in result.stdout, result.stdout + result.stderr


def test_bench_passes_options_to_the_one_named_benchmark_and_refuses_them_for_several():
    from qgather.cli import bench

    seen = []

    def fake_main(argv):
        seen.append(list(argv))
        return 0

    original = dict(bench.BENCHES)
    try:
        bench.BENCHES.update({"formats": lambda: fake_main, "gpu": lambda: fake_main})
        assert bench.main(["gpu", "--backend", "gloo", "--profile"]) == 0
        assert seen == [["--backend", "gloo", "--profile"]]
        assert bench.main(["formats", "gpu", "--profile"]) == 4
        assert bench.main(["nope"]) == 4
        assert seen == [["--backend", "gloo", "--profile"]]
    finally:
        bench.BENCHES.clear()
        bench.BENCHES.update(original)


def test_each_light_parser_says_what_its_tool_says_of_itself():
    """The parsers built before torch loads carry their tool's description as a copy: it must stay
    the tool docstring's first paragraph."""
    from qgather.cli import arguments as cli_arguments
    from qgather.cli import sweep
    from qgather.tools import arguments, golden, selftest

    for parser, module in ((arguments.selftest_parser(), selftest), (arguments.golden_parser(), golden),
                           (cli_arguments.sweep_parser(), sweep)):
        assert parser.description == " ".join(module.__doc__.split("\n\n")[0].split()), module.__name__
