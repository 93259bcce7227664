"""The checkout's pytest root. qgather's plugin (options, the `case` parametrization, the `qgather`
fixture, the verdict reports) loads through its pytest11 entry point, so the project must be
installed (`make test` installs it editable into .venv): say so in one line rather than fail on
every option."""

import importlib.util

import pytest

if importlib.util.find_spec("qgather") is None:
    raise pytest.UsageError("qgather is not installed in this Python: run `make test`, or `pip install -e .` "
                            "in a virtual environment, then pytest")
