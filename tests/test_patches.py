"""qgather.instruments.patches: every patch of torch.distributed or of a subclass's FSDP2 hooks puts back
exactly what was there, on a normal exit, on an exception, and when patches nest."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qgather.instruments import patches
from qgather.model.phases import Phase, PhaseTracker


class Base:
    def fsdp_pre_all_gather(self, mesh):
        return (torch.ones(2),), "meta"

    def fsdp_post_all_gather(self, outputs, metadata, dtype):
        return outputs[0], None


class Inherits(Base):
    pass


def _gathers() -> dict[str, object]:
    return {name: getattr(dist, name) for name in patches.ALL_GATHER_FUNCTIONS if hasattr(dist, name)}


@pytest.mark.parametrize("owner", [Base, Inherits])
def test_nested_patches_restore_the_originals_even_on_an_error(owner):
    gathers, phases = _gathers(), PhaseTracker()
    hooks = dict(vars(Base)), dict(vars(Inherits))
    with pytest.raises(RuntimeError, match="inside"):
        with patches.hooks_moving_phase(phases, (owner,)), patches.float8_all_gathers_as_bytes():
            with patches.all_gathers_counted(lambda t: None), patches.pre_all_gather_observed((owner,), print):
                assert vars(owner)["fsdp_pre_all_gather"] is not hooks[0]["fsdp_pre_all_gather"]
                assert all(getattr(dist, name) is not fn for name, fn in gathers.items())
                raise RuntimeError("inside")
    assert _gathers() == gathers
    assert (dict(vars(Base)), dict(vars(Inherits))) == hooks  # an inherited hook is removed again, not copied


def test_the_hooks_move_the_phase_and_their_outputs_are_observed():
    phases, seen = PhaseTracker(), []
    local = Inherits()
    with patches.hooks_moving_phase(phases, (Inherits,)), patches.pre_all_gather_observed((Inherits,), seen.append):
        inputs, metadata = local.fsdp_pre_all_gather(None)
        assert phases.current is Phase.COLLECTIVE
        local.fsdp_post_all_gather(inputs, metadata, torch.float32)
    assert phases.current is Phase.COLLECTIVE and len(seen) == 1 and seen[0][0].shape == (2,)


def test_only_the_outermost_all_gather_is_counted(monkeypatch):
    """FSDP2's all-gather function may call the other one: that inner call moves no further bytes."""
    outer_name, inner_name = patches.ALL_GATHER_FUNCTIONS
    monkeypatch.setattr(dist, outer_name, lambda output, input, **kw: getattr(dist, inner_name)(output, input),
                        raising=False)
    monkeypatch.setattr(dist, inner_name, lambda output, input, **kw: None, raising=False)
    counted = []
    with patches.all_gathers_counted(counted.append):
        getattr(dist, outer_name)(torch.empty(4), torch.empty(2))
        getattr(dist, inner_name)(torch.empty(6), torch.empty(3))
    assert [t.shape for t in counted] == [(2,), (3,)]
