"""Quiet by default: library noise filtered to one line (pytest's final line kept and qgather's help first:
test_cli_ux)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)


def test_torchao_library_warnings_are_one_line_at_most():
    pytest_torchao = __import__("pytest").importorskip("torchao")
    del pytest_torchao
    result = run("-c", "import qgather.pytest_plugin, torchao")
    noisy = [line for line in result.stderr.splitlines() if line.strip()]
    assert not [line for line in noisy if "Failed to load" in line or "register_constant" in line], noisy
    assert len(noisy) <= 1, noisy


def test_filter_keeps_one_summary_line():
    import logging

    from qgather.quiet import _TorchaoLibraryFilter

    f = _TorchaoLibraryFilter()
    records = [logging.LogRecord("torchao", logging.WARNING, "x", 1, f"Failed to load lib{i}.so: nope", (), None)
               for i in range(5)]
    kept = [r for r in records if f.filter(r)]
    assert len(kept) == 1 and kept[0].getMessage().startswith("torchao: optional kernel libraries")
    other = logging.LogRecord("torchao", logging.WARNING, "x", 1, "something else", (), None)
    assert f.filter(other)


# `qgather run -q` keeps pytest's final line: test_cli_ux's short-summary run passes -q and checks it.
# `qgather run --help` shows qgather's options first: test_cli_ux's --help test of every command checks it.


def test_rank_processes_add_no_torchao_warnings():
    # torchao is imported in every rank that runs a torchao case; only the runner's summary line remains.
    result = run("-m", "qgather", "case", "torchao:fp8_tensor:64x64:bf16:ws2:gather:s0")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if "torchao" in line.lower() or "Failed to load" in line]
    assert len(lines) <= 1, "\n".join(lines[:10])
