"""Virtual worlds: one process emulates FSDP2's chunking, padding and concatenation, for sweeps
up to 1024 ranks that no pool could run; with tensor parallelism, dp x tp worlds of 64 to 1024
ranks (qgather.suite.tp_sweep.TensorParallelVirtual)."""

import pytest

from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict
from qgather.suite.selection import declares, runnable
from qgather.suite.sweeps import LEAN_SHAPES, RULES_ONLY, CaseSet, Sweep
from qgather.suite.tp_sweep import TensorParallelVirtual

#: the four core shapes at the world sizes a pool can run too (where the emulation is compared with the
#: real gathers), the rule cover alone at the larger ones: a 1024-rank emulation costs ~0.5 s on CI
SWEEP = CaseSet([Sweep(scenarios=("virtual",), dtypes=("bf16",), world_sizes=(1, 2, 3, 4, 8), shapes=LEAN_SHAPES),
                 Sweep(scenarios=("virtual",), dtypes=("bf16",), world_sizes=(16, 64, 256, 1024), shapes=RULES_ONLY),
                 TensorParallelVirtual()])


def test_virtual(case, qgather):
    qgather.check(case)


AGREEMENT = Sweep(scenarios=("gather",), dtypes=("bf16",), world_sizes=(1, 2, 3, 4))


def test_virtual_agrees_with_real_gathers(qgather, request):
    """On every size both can run, the emulated world gives the real gather's verdict."""
    # deferred: `qgather list --cases` imports this module for its SWEEP alone, without the plugin
    from qgather.pytest_plugin.options import settings

    options = settings(request.config)
    fmt = (options.formats or ("nvfp4_2d",))[0]
    device = options.run.device_type()
    reals = runnable(AGREEMENT.cases(options.impls, formats=[fmt], world_sizes=options.world_sizes), None, device)
    pairs = [(real, CaseSpec(real.impl, real.fmt, real.shape, real.dtype, real.world_size, "virtual", real.seed))
             for real in reals]
    pairs = [(real, virtual) for real, virtual in pairs if declares(virtual, device)]
    if not pairs:  # nothing to compare must not pass as an agreement
        pytest.skip(f"no selected implementation declares both the gather and virtual scenarios of {fmt}")
    disagree = []
    for real, virtual in pairs:
        a, b = qgather.run(real), qgather.run(virtual)
        if Verdict.SKIPPED in (a.verdict, b.verdict):
            continue  # an implementation that cannot run one of the two has nothing to agree on
        if a.verdict is not b.verdict:
            disagree.append(f"{real.id}: real {a.verdict.value}, virtual {b.verdict.value}")
    assert not disagree, "\n".join(disagree)
