"""Collection: a case module's `SWEEP` becomes the `case` parametrization of its tests, narrowed by
the session's selection (--impl, --formats, --world-sizes, --scenarios, --exhaustive).

Test modules under cases/ (qgather/cases/ of an install) declare
`SWEEP = qgather.suite.sweeps.Sweep(...)` (or another qgather.suite.sweeps.SuiteSweep), optionally
`IMPLS = [...]`, and one test taking `case` and `qgather`.
"""

from __future__ import annotations

import dataclasses

import pytest

from qgather.pytest_plugin.options import settings
from qgather.pytest_plugin.role import Role, role
from qgather.runtime.launch import default_world_sizes, detect_launch
from qgather.suite.sweeps import CaseSet, Sweep

# How many cases each parametrized sweep yielded (a --world-sizes that no sweep has selects none).
sweep_sizes_key = pytest.StashKey[list[int]]()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize `case` with the module's SWEEP under the session's selection."""
    if "case" not in metafunc.fixturenames:
        return
    sweep = getattr(metafunc.module, "SWEEP", None)
    if sweep is None:
        return
    options = settings(metafunc.config)
    impls = getattr(metafunc.module, "IMPLS", None) or list(options.impls)
    launch = detect_launch()
    # Under a launcher the job's sizes, not a one-host pool's; --world-sizes selects as it does without one.
    if launch is not None and not options.world_sizes:
        sweep = _on_job(sweep, default_world_sizes(launch.world_size))
    selection = dict(formats=options.formats, world_sizes=options.world_sizes, scenarios=options.scenarios)
    cases = sweep.cases(impls, **selection)
    default = {c.id for c in cases}
    if options.exhaustive:
        cases = sweep.cases(impls, exhaustive=True, **selection)
    metafunc.config.stash.setdefault(sweep_sizes_key, []).append(len(cases))
    marks = [getattr(pytest.mark, m) for m in sweep.marks]
    slow = [*marks, pytest.mark.slow]
    params = [pytest.param(c, id=c.id, marks=marks if c.id in default else slow) for c in cases]
    metafunc.parametrize("case", params)


def _on_job(sweep: object, sizes: list[int]) -> object:
    """The sweep with the launched job's world sizes for its world-size-free parts (a Sweep of real
    scenarios, also inside a CaseSet); sweeps with sizes of their own (virtual, tp meshes) keep them."""
    if isinstance(sweep, Sweep) and "virtual" not in sweep.scenarios:
        return dataclasses.replace(sweep, world_sizes=sizes)
    if isinstance(sweep, CaseSet):
        return dataclasses.replace(sweep, sweeps=[_on_job(s, sizes) for s in sweep.sweeps])
    return sweep


def pytest_collection_finish(session: pytest.Session) -> None:
    """A selection (--formats, --world-sizes, --scenarios) that matches no case of the sweeps
    collected would otherwise pass green with nothing run: a usage error."""
    if role(session.config) is Role.XDIST_WORKER:
        return  # an xdist worker cannot stop the session cleanly; `qgather run` checks before pytest starts
    options = settings(session.config)
    counts = session.config.stash.get(sweep_sizes_key, None)
    if counts is None or sum(counts):
        return  # the selection has cases
    if options.world_sizes:
        raise pytest.UsageError(f"--world-sizes {','.join(map(str, options.world_sizes))}: no case in the selected "
                                "suite has that world size")
    given = [f"{flag} {','.join(map(str, value))}" for flag, value in (
        ("--formats", options.formats), ("--scenarios", options.scenarios)) if value]
    if given and counts:  # sweeps were collected, none with a case of this selection
        raise pytest.UsageError(f"{' '.join(given)}: no case of the suite matches this selection")
