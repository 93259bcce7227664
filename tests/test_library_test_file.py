"""A library's own test file uses qgather's fixtures and parametrization: an installed qgather
registers its plugin (pytest11 entry point), the module names its adapter and its sweep, and every
case becomes one pytest test with qgather's verdict policy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ADAPTER = '''
from qgather.impls.reference import ReferenceImplementation

class MyImpl(ReferenceImplementation):
    """A library's subclass; here the reference under another name."""
'''

TEST_FILE = '''
from qgather.suite.sweeps import Sweep

IMPLS = ["mylib_adapters:MyImpl"]
SWEEP = Sweep(scenarios=("gather", "virtual"), formats=("nvfp4_2d",), world_sizes=(1, 2), dtypes=("bf16",),
              shapes=lambda fmt: [(128, 64), (136, 64)])


def test_my_subclass_gathers_exactly(case, qgather):
    qgather.check(case)
'''


def test_a_library_test_file_runs_its_cases_through_qgather(tmp_path):
    (tmp_path / "mylib_adapters.py").write_text(textwrap.dedent(ADAPTER))
    (tmp_path / "test_mylib.py").write_text(textwrap.dedent(TEST_FILE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "test_mylib.py", "-p", "qgather", "-p", "no:cacheprovider",
         "-q", "--device", "cpu", "-rA"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "8 passed" in result.stdout, result.stdout[-2000:]
    assert "mylib_adapters:MyImpl:nvfp4_2d:136x64:bf16:ws2:gather:s0" in result.stdout
