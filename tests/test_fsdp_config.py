"""The FSDP2 configuration id component: round trips, stays out of default ids, refuses bad tokens."""

import pytest

from qgather.model.case import CaseSpec, CaseSpecError
from qgather.model.config import ConfigError, FsdpConfig

BASE = "reference:nvfp4_2d:136x64:bf16:ws4:gather:s0"


@pytest.mark.parametrize("token", ["mp-bf16", "mp-fp32-rbf16", "raf-no", "raf-2", "raf-1", "hsdp-2x2", "hsdp-1x4",
                                   "hsdp-4x1", "dim1", "compile", "dcp-ws8",
                                   "mp-bf16-rfp32+raf-2+hsdp-2x2+dim1+compile+dcp-ws2"])
def test_config_round_trips_through_the_case_id(token):
    spec = CaseSpec.parse(f"{BASE}:{token}")
    assert spec.config.token == token
    assert spec.id == f"{BASE}:{token}"


def test_default_configuration_leaves_ids_unchanged():
    spec = CaseSpec.parse(BASE)
    assert spec.config.is_default and spec.id == BASE


def test_int_one_reshard_is_not_the_default():
    assert not FsdpConfig(reshard_after_forward=1).is_default


def test_impl_names_with_colons_still_parse_with_a_config():
    spec = CaseSpec.parse("pkg.mod:obj:fp8_tensor:64x64:bf16:ws2:gather:s1:raf-no")
    assert spec.impl == "pkg.mod:obj" and spec.config.reshard_after_forward is False


@pytest.mark.parametrize("token, message", [
    ("foo", "is not one of"),
    ("hsdp-2x1", "needs 2 ranks, the case has 4"),
    ("mp-fp16", "is not one of bf16, fp32"),
    ("raf-0", "must be >= 1"),
    ("raf-no+raf-2", "repeats a setting"),
])
def test_bad_configuration_tokens_name_the_problem(token, message):
    with pytest.raises(CaseSpecError, match=message):
        CaseSpec.parse(f"{BASE}:{token}")


def test_a_checkpoint_saved_after_a_training_forward_has_its_own_token():
    config = FsdpConfig.parse("mp-bf16+dcp-ws3-trained")
    assert config.saved_at_world_size == 3 and config.saved_after_forward
    assert config.token == "mp-bf16+dcp-ws3-trained"
    assert not FsdpConfig.parse("dcp-ws3").saved_after_forward
    with pytest.raises(ConfigError, match="needs a checkpoint"):
        FsdpConfig(saved_after_forward=True)
