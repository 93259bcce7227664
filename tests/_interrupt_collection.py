"""A pytest plugin (`-p tests._interrupt_collection`) that interrupts the session while it collects, before
any deselection: a Ctrl-C landing while a large suite is still being collected (tests/test_cli_ux.py)."""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    raise KeyboardInterrupt
