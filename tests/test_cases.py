import pytest

from qgather.model.case import CaseSpec, CaseSpecError, ShardLayout, shard_layout


def test_id_round_trip():
    spec = CaseSpec("reference", "nvfp4_2d", (136, 64), "bf16", 8, "gather", 0)
    assert spec.id == "reference:nvfp4_2d:136x64:bf16:ws8:gather:s0"
    assert CaseSpec.parse(spec.id) == spec


@pytest.mark.parametrize("impl", ["mutant:per_rank_amax", "mypkg.adapters:MyImpl"])
def test_implementation_names_may_hold_colons(impl):
    spec = CaseSpec.parse(f"{impl}:fp8_block:4x128x64:fp32:ws3:steps:s7")
    assert (spec.impl, spec.shape, spec.dtype, spec.world_size, spec.scenario, spec.seed) == (
        impl, (4, 128, 64), "fp32", 3, "steps", 7)


@pytest.mark.parametrize("bad, words", [
    ("reference:nvfp4_2d:136x64", "must read impl:format"),
    ("reference:nvfp4_2d:136xA:bf16:ws8:gather:s0", "must be integers"),
    ("reference:nvfp4_2d:136x64:fp16:ws8:gather:s0", "dtype 'fp16'"),
    ("reference:nvfp4_2d:136x64:bf16:ws0:gather:s0", "world size must be >= 1"),
    ("reference:nvfp4_2d:136x64:bf16:ws2:scatter:s0", "scenario 'scatter'"),
    ("reference:nvfp4_2d:136:bf16:ws2:gather:s0", ">= 2 positive dims"),
])
def test_bad_ids_say_what_is_wrong_in_one_line(bad, words):
    with pytest.raises(CaseSpecError) as info:
        CaseSpec.parse(bad)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_shard_layout_follows_torch_chunk():
    # 136 rows on 8 ranks: 17-row chunks; the 16-row block is split from rank 1 on.
    layout = ShardLayout(136, 8, 1)
    assert layout.chunk == 17 and layout.even
    assert layout.misaligned_rank(16) == 1
    assert layout.owner_of_row(33) == 1 and layout.owner_of_row(34) == 2
    # 4 rows on 8 ranks: one row each on ranks 0-3, zero rows on ranks 4-7 (torch.chunk semantics).
    small = ShardLayout(4, 8, 1)
    assert [small.row_range(r) for r in (0, 3, 4, 7)] == [(0, 1), (3, 4), (4, 4), (4, 4)]
    assert small.misaligned_rank(1) is None
    # 46 rows on 3 ranks: chunks 16, 16, 14 - uneven but every shard starts on a 16-row block.
    assert ShardLayout(46, 3, 1).misaligned_rank(16) is None
    # 3-D experts: FSDP2 splits dim 0 (experts); each holds inner_rows flattened rows.
    experts = shard_layout(CaseSpec("reference", "mxfp8", (3, 32, 64), "bf16", 2, "gather"))
    assert experts.row_range(1) == (64, 96) and experts.misaligned_rank(32) is None
