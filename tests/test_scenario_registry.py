"""qgather.scenarios.registry: every scenario the case model names has exactly one runner, and a
rank refuses a scenario it does not run, naming it."""

from __future__ import annotations

import pytest

from qgather.errors import HarnessFault
from qgather.model.case import SCENARIOS, CaseSpec
from qgather.scenarios import registry


def test_the_registry_covers_exactly_the_case_models_scenarios():
    assert sorted({*registry.ON_RANKS, *registry.IN_ONE_PROCESS}) == sorted(SCENARIOS)
    assert not set(registry.ON_RANKS) & set(registry.IN_ONE_PROCESS)
    with pytest.raises(HarnessFault, match=r"no runner \['sharded_steps'\]"):
        registry._check_covers((*SCENARIOS, "sharded_steps"))
    with pytest.raises(HarnessFault, match=r"unknown \['hooks'\]"):
        registry._check_covers(tuple(s for s in SCENARIOS if s != "hooks"))


def test_a_rank_refuses_the_virtual_scenario_with_the_reason():
    spec = CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:virtual:s0")
    with pytest.raises(HarnessFault, match="runs in one process, not on a rank pool"):
        registry.run_on_rank(None, spec)
