"""Collection: a case module's `SWEEP` becomes the `case` parametrization of its tests, narrowed by
the session's selection (--impl, --formats, --world-sizes, --scenarios, --exhaustive).

Test modules under cases/ (qgather/cases/ of an install) declare
`SWEEP = qgather.suite.sweeps.Sweep(...)` (or another qgather.suite.sweeps.SuiteSweep), optionally
`IMPLS = [...]`, and one test taking `case` and `qgather`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import pytest
import torch

from qgather.impls import UnknownImplementationError, get_impl
from qgather.model.case import CaseSpec, CaseSpecError
from qgather.paths import suite_dir
from qgather.pytest_plugin.options import settings
from qgather.pytest_plugin.role import Role, role
from qgather.runtime.helpers import COMPILE_WARMUP, preload_for_run
from qgather.runtime.launch import default_world_sizes, detect_launch
from qgather.suite import memo
from qgather.suite.selection import runnable, unmatched, why_empty
from qgather.suite.sweeps import CaseSet, Sweep

# The cases each parametrized sweep yielded (a listed value that no sweep has selects none).
sweep_sizes_key = pytest.StashKey[list[list[CaseSpec]]]()
# Why a case module's IMPLS cannot be loaded (one line each): the session stops with the first.
impl_problems_key = pytest.StashKey[list[str]]()
# The generated cases of this collection, kept in qgather.suite.memo (written once, when collection ends).
memo_key = pytest.StashKey[memo.Memo]()
# The cases of the companion sets (e.g. torchao's own beside the default run's) this collection yielded.
companion_cases_key = pytest.StashKey[list[CaseSpec]]()
# The forkserver preload list before this session added to it (set only if it did).
preload_before_key = pytest.StashKey[str | None]()
#: the mark expression of the default run (qgather.cli.run.default_markers), which deselects the slow sweeps
DEFAULT_MARKEXPR = "not slow"
#: the id of the stand-in a slow sweep gets under it (no case id: qgather.pytest_plugin.collection.case_in)
SLOW_SWEEP_ID = "slow-sweep-not-generated"
#: the module of every case function a rank runs (qgather.scenarios.registry.run_on_rank)
SCENARIOS_MODULE = "qgather.scenarios.registry"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize `case` with the module's SWEEP under the session's selection."""
    if "case" not in metafunc.fixturenames:
        return
    sweep = getattr(metafunc.module, "SWEEP", None)
    if sweep is None:
        return
    if "slow" in sweep.marks and (metafunc.config.option.markexpr or "").strip() == DEFAULT_MARKEXPR:
        # The default run deselects every case of a slow sweep (test_fsdp_configs_full: 11190 of them,
        # each a pytest item that every xdist worker built and reported, about 1.5 s of CPU a worker):
        # one deselected stand-in instead.
        metafunc.parametrize("case", [pytest.param(None, id=SLOW_SWEEP_ID, marks=[pytest.mark.slow])])
        return
    options = settings(metafunc.config)
    fixed = getattr(metafunc.module, "IMPLS", None)
    impls = fixed or list(options.impls)
    if not _loadable(metafunc.config, impls):
        if role(metafunc.config) is Role.XDIST_WORKER:  # it cannot stop the session: a collection error
            raise pytest.UsageError(metafunc.config.stash[impl_problems_key][-1])
        metafunc.parametrize("case", [])
        return
    named = impls if fixed or options.impls_named else None
    device = options.run.device_type()
    launch = detect_launch()
    # Under a launcher the job's sizes, not a one-host pool's; --world-sizes selects as it does without one.
    if launch is not None and not options.world_sizes:
        sweep = _on_job(sweep, default_world_sizes(launch.world_size))
    selection = dict(formats=options.formats, world_sizes=options.world_sizes, scenarios=options.scenarios)
    suite_module = None if launch is not None else _suite_module(metafunc.module)
    if suite_module:  # as `qgather list --cases` keys them: each xdist worker skips the covering designs
        generated = _memo(metafunc.config).cases(suite_module, sweep, impls, **selection, exhaustive=False)
    else:
        generated = sweep.cases(impls, **selection)
    cases = runnable(generated, named, device)
    default = {c.id for c in cases}
    if options.exhaustive:
        cases = runnable(sweep.cases(impls, exhaustive=True, **selection), named, device)
    metafunc.config.stash.setdefault(sweep_sizes_key, []).append(cases)
    marks = [getattr(pytest.mark, m) for m in sweep.marks]
    slow = [*marks, pytest.mark.slow]
    params = [pytest.param(c, id=c.id, marks=marks if c.id in default else slow) for c in cases]
    metafunc.parametrize("case", params)


def case_in(nodeid: str) -> CaseSpec | None:
    """The case a test node checks, read from its parametrize id with CaseSpec.parse (the one reader
    of case ids; under xdist the controller has the node ids alone); None for a test of no one case."""
    try:
        return CaseSpec.parse(nodeid.partition("[")[2].removesuffix("]"))
    except CaseSpecError:
        return None


def parametrize_companion(metafunc: pytest.Metafunc, name: str, cases: CaseSet, impls: Sequence[str]) -> None:
    """Parametrize `name` with a module's companion set (e.g. torchao's own cases beside the default
    run's): every case of `impls` the selection keeps, or none when --impl names the implementations
    (a named run gets its cases from the module's SWEEP)."""
    options = settings(metafunc.config)
    chosen = [] if options.impls_named else list(impls)
    selection = dict(formats=options.formats, world_sizes=options.world_sizes, scenarios=options.scenarios)
    suite_module = _suite_module(metafunc.module) if chosen else None
    if suite_module:
        specs = _memo(metafunc.config).cases(f"{suite_module} (companions)", cases, chosen, **selection)
    else:
        specs = cases.cases(chosen, **selection)
    specs = runnable(specs, None, options.run.device_type())  # what each implementation declares
    metafunc.config.stash.setdefault(companion_cases_key, []).extend(specs)
    marks = [getattr(pytest.mark, m) for m in cases.marks]
    metafunc.parametrize(name, [pytest.param(c, id=c.id, marks=marks) for c in specs])


def _memo(config: pytest.Config) -> memo.Memo:
    if memo_key not in config.stash:
        config.stash[memo_key] = memo.Memo()
    return config.stash[memo_key]


def _suite_module(module: object) -> str | None:
    """The name qgather.suite.modules gives a case module of the suite's own directory (whose bytes key
    qgather.suite.memo), None for any other test file (a library's own, a test's): its cases are computed."""
    path = getattr(module, "__file__", None) or ""
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(suite_dir()):
        return None
    return os.path.basename(path)[:-3]


def _loadable(config: pytest.Config, impls: list[str]) -> bool:
    """Whether every implementation loads; else its one-line reason is kept for the session's end."""
    for name in impls:
        try:
            get_impl(name)
        except UnknownImplementationError as exc:
            config.stash.setdefault(impl_problems_key, []).append(str(exc))
            return False
    return True


def _on_job(sweep: object, sizes: list[int]) -> object:
    """The sweep with the launched job's world sizes for its world-size-free parts (a Sweep of real
    scenarios, also inside a CaseSet); sweeps with sizes of their own (virtual, tp meshes) keep them."""
    if isinstance(sweep, Sweep) and "virtual" not in sweep.scenarios:
        return dataclasses.replace(sweep, world_sizes=sizes)
    if isinstance(sweep, CaseSet):
        return dataclasses.replace(sweep, sweeps=[_on_job(s, sizes) for s in sweep.sweeps])
    return sweep


EMPTY_PARAMETER_SET = "got empty parameter set"  # pytest's skip reason for a test parametrized with nothing


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A run of named implementations leaves out the tests that have no case of them (pytest would skip
    each one, "got empty parameter set"): deselected, as -k deselects, so that its skips are its cases'."""
    if not settings(config).impls_named:
        return
    empty = [item for item in items if _parametrized_with_nothing(item)]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if not _parametrized_with_nothing(item)]


def rank_preloads(config: pytest.Config) -> list[str]:
    """What the forkserver of this run imports once for all its ranks: the compile warm-up where cases
    compile; on a CPU build of torch also the scenarios (each rank's first case imports them) and the
    modules the run's implementations import on use (`rank_imports`: torchao's float8 API). Not on a
    CUDA build: a module imported there must leave CUDA usable in the ranks forked from it, which the
    GPU job checks for the modules it names itself (qgather.runtime.helpers.fork_safe)."""
    cases = [c for cases in config.stash.get(sweep_sizes_key, None) or [] for c in cases]
    cases += config.stash.get(companion_cases_key, None) or []
    preloads = [COMPILE_WARMUP] if any(c.config.compile for c in cases) else []
    if not cases or torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return preloads
    preloads.append(SCENARIOS_MODULE)
    for name in sorted({c.impl for c in cases}):
        try:
            preloads += [m for m in get_impl(name).rank_imports if m not in preloads]
        except UnknownImplementationError:
            continue  # reported on its own (impl_problems_key)
    return preloads


def _parametrized_with_nothing(item: pytest.Item) -> bool:
    return any(mark.name == "skip" and str(mark.kwargs.get("reason", "")).startswith(EMPTY_PARAMETER_SET)
               for mark in item.iter_markers())


def pytest_collection_finish(session: pytest.Session) -> None:
    """A selection (--formats, --world-sizes, --scenarios) that matches no case of the sweeps
    collected would otherwise pass green with nothing run: a usage error. In every process that runs
    cases: compiled cases among them have the forkserver warm torch.compile up for the ranks."""
    if memo_key in session.config.stash:
        session.config.stash[memo_key].flush()
    preloads = rank_preloads(session.config)
    if preloads and preload_before_key not in session.config.stash:
        session.config.stash[preload_before_key] = preload_for_run(preloads)  # restored at pytest_unconfigure
    if role(session.config) is Role.XDIST_WORKER:
        return  # an xdist worker cannot stop the session cleanly; `qgather run` checks before pytest starts
    problems = session.config.stash.get(impl_problems_key, None)
    if problems:
        raise pytest.UsageError(problems[0])
    options = settings(session.config)
    per_sweep = session.config.stash.get(sweep_sizes_key, None)
    if not per_sweep:
        return  # no case module was collected
    cases = [c for sweep_cases in per_sweep for c in sweep_cases]
    if cases:
        named = options.impls if options.impls_named else None
        problem = unmatched(cases, options.formats, options.world_sizes, options.scenarios, named,
                            options.run.device_type())
        if problem:
            raise pytest.UsageError(problem)
        return  # the selection has cases
    reason = why_empty(options.impls, options.run.device_type()) if options.impls_named else ""
    if reason:
        raise pytest.UsageError(reason)
    if options.world_sizes:
        raise pytest.UsageError(f"--world-sizes {','.join(map(str, options.world_sizes))}: no case in the selected "
                                "suite has that world size")
    given = [f"{flag} {','.join(map(str, value))}" for flag, value in (
        ("--formats", options.formats), ("--scenarios", options.scenarios)) if value]
    if given:  # sweeps were collected, none with a case of this selection
        raise pytest.UsageError(f"{' '.join(given)}: no case of the suite matches this selection")
