# The harness's pytest integration lives in a plugin module so that the options, fixtures and
# reporting hooks are importable (and testable) like any other harness code.
pytest_plugins = ("harness.pytest_plugin",)
