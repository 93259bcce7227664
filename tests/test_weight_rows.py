"""Drawing only some rows of a weight (qgather.scenarios.data): a large weight on a device is drawn in
row blocks, each from its own generator, so that a gather case whose golden and twin are kept draws
only its shard's rows (qgather.scenarios.fsdp.rows_to_draw), the others NaN."""

from __future__ import annotations

import pytest
import torch

from qgather.check import golden_cache
from qgather.check.golden import golden_for
from qgather.check.inspection import TwinOutput
from qgather.formats import FORMATS
from qgather.impls.reference import ReferenceImplementation
from qgather.model.case import CaseSpec, shard_layout, tensor_parallel_layout
from qgather.model.phases import PhaseTracker
from qgather.model.tp_rank import TensorParallelRank
from qgather.runtime.rank import CaseContext
from qgather.scenarios import data, fsdp_setup
from qgather.scenarios.context import RankCase
from qgather.scenarios.fsdp import rows_to_draw

CPU = torch.device("cpu")
SPEC = CaseSpec.parse("reference:fp8_tensor:23x8:bf16:ws2:gather:s5")
BLOCK = 4 * 8  # 4 rows of 8 per block: blocks [0, 4), [4, 8), ... [20, 23)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(0, 23), (5, 14), (4, 8), (22, 23), (0, 1), (7, 7)])
def test_some_rows_hold_the_full_draws_bits_and_the_others_are_nan(rows, dtype):
    full = data._draw_blockwise(SPEC, 5, CPU, dtype, block_elements=BLOCK)
    part = data._draw_blockwise(SPEC, 5, CPU, dtype, rows, block_elements=BLOCK)
    start, stop = rows
    assert not full.isnan().any()
    assert torch.equal(_bits(part[start:stop]), _bits(full[start:stop]))
    assert part[:start].isnan().all() and part[stop:].isnan().all()


@pytest.mark.parametrize("rows,blocks", [((5, 14), [1, 2, 3]), ((4, 8), [1]), ((22, 23), [5]), ((7, 7), []),
                                         (None, [0, 1, 2, 3, 4, 5])])
def test_only_the_blocks_holding_the_rows_are_drawn(monkeypatch, rows, blocks):
    seeds = []

    def spy(seed, device="cpu"):
        seeds.append(seed)
        return torch.Generator(device=device).manual_seed(seed)

    monkeypatch.setattr(data, "_generator", spy)
    data._draw_blockwise(SPEC, 5, CPU, torch.float32, rows, block_elements=BLOCK)
    assert seeds == [data.block_seed(5, i) for i in blocks]


def test_each_block_is_drawn_from_its_own_documented_seed():
    full = data._draw_blockwise(SPEC, 5, CPU, torch.float32, block_elements=BLOCK)
    scales = data.row_scales(SPEC)
    for index, start in enumerate(range(0, 23, 4)):
        stop = min(start + 4, 23)
        block = torch.randn((stop - start, 8), generator=torch.Generator().manual_seed(data.block_seed(5, index)))
        assert torch.equal(full[start:stop], block * scales[start:stop]), index
    assert data.block_seed(5, 1) == 5 * data.BLOCK_SEED_STRIDE + 1
    with pytest.raises(ValueError):
        data.block_seed(5, data.BLOCK_SEED_STRIDE)  # it would be seed 6's block 0


def test_the_cpu_generators_draw_is_unchanged_and_takes_rows_too():
    expected = torch.randn(SPEC.shape, generator=torch.Generator().manual_seed(5)) * data.row_scales(SPEC)
    assert torch.equal(data.make_weight(SPEC), expected)
    part = data.make_weight(SPEC, rows=(3, 9))
    assert torch.equal(part[3:9], expected[3:9]) and part[:3].isnan().all() and part[9:].isnan().all()
    with pytest.raises(ValueError):
        data.make_weight(SPEC, rows=(3, 24))


def test_only_large_weights_off_the_cpu_are_drawn_blockwise():
    large = CaseSpec.parse("reference:fp8_tensor:4096x2048:bf16:ws2:gather:s0")
    assert data.draws_blockwise(large, "cuda") and data.draws_blockwise(large, torch.device("cuda", 1))
    assert not data.draws_blockwise(large, "cpu") and not data.draws_blockwise(large, None)
    assert not data.draws_blockwise(SPEC, "cuda")


# ------------------------------------------------------------------ which rows a gather case draws
class OwnRows(ReferenceImplementation):
    reads_own_rows_only = True


class OwnRowsWithTwin(OwnRows):
    def single_device_output(self, spec, weight, x):
        raise AssertionError("not called: rows_to_draw only asks whether a twin would be built")


LARGE = "fp8_tensor:4096x2048:bf16:ws2:gather:s0"
GPU = torch.device("cuda", 0)  # a device object only: nothing is allocated on it


def _case(case_id: str = LARGE, impl=None, device: torch.device = GPU, golden: bool = True, twin: bool = True,
          checkpoint: str | None = None) -> RankCase:
    """Rank 1's RankCase of `case_id`, its golden and twin output kept (as an earlier case leaves them)."""
    impl = impl or OwnRowsWithTwin()
    spec = CaseSpec.parse(f"{type(impl).__name__}:{case_id}")
    ctx = CaseContext(1, spec.world_size, "gloo", device, None, 0, case_id, lambda: None)
    layout = tensor_parallel_layout(spec)
    tp = None if layout is None else TensorParallelRank(layout, 0, None)
    setup = fsdp_setup.Setup({}, shard_layout(spec), 1, spec.torch_dtype, tp)
    case = RankCase(ctx, spec, impl, FORMATS[spec.fmt], PhaseTracker(), setup, torch.zeros(8, spec.shape[-1]),
                    checkpoint)
    cache = golden_cache.kept_in(ctx.kept)
    if golden:
        small = data.make_weight(CaseSpec.parse("reference:fp8_tensor:16x32:bf16:ws2:gather:s0"))
        cache.get(golden_cache.GoldenKey.of(spec, device), lambda: golden_for(FORMATS["fp8_tensor"], small))
    if twin:
        cache.keep_twin(golden_cache.TwinKey.of(spec, device, setup.param_dtype), TwinOutput(note="kept"))
    return case


def test_a_gather_case_with_everything_kept_draws_its_shards_rows():
    case = _case()
    assert case.golden_kept() and golden_cache.kept_in(case.ctx.kept).hits == 0  # asking is no use
    assert rows_to_draw(case, case.kept_twin()) == (2048, 4096)
    no_twin = _case(impl=OwnRows(), twin=False)  # no twin to build: none needs keeping
    assert rows_to_draw(no_twin, no_twin.kept_twin()) == (2048, 4096)


@pytest.mark.parametrize("why,case", [
    ("steps", lambda: _case(LARGE.replace("gather", "steps"))),
    ("checkpoint", lambda: _case(LARGE + ":dcp-ws4", checkpoint="/saved")),
    ("golden not kept", lambda: _case(golden=False)),
    ("twin not kept", lambda: _case(twin=False)),
    ("tensor parallel", lambda: _case(LARGE.replace("ws2", "ws4") + ":tp-2x2")),
    ("Shard(1)", lambda: _case(LARGE + ":dim1")),
    ("the harness's route", lambda: _case(impl=ReferenceImplementation())),
    ("small weight", lambda: _case(LARGE.replace("4096x2048", "128x64"))),
    ("on the cpu", lambda: _case(device=CPU)),
])
def test_a_case_draws_every_row_unless_every_condition_holds(why, case):
    case = case()
    assert rows_to_draw(case, case.kept_twin()) is None, why


# ------------------------------------------------------------------ a gather case on a pool
def gather_twice(ctx, case_id: str) -> tuple[list, list]:
    """On a pool rank: the case twice from a fresh cache, every weight drawn as if large on a GPU
    (drawn blockwise); the rows each draw asked for, and the results."""
    from qgather.scenarios import fsdp
    from qgather.scenarios.registry import run_on_rank

    ctx.kept.clear()
    asked, make_weight, blockwise = [], fsdp.make_weight, fsdp.draws_blockwise

    def recording(*args, rows=None, **kwargs):
        asked.append(rows)
        return make_weight(*args, rows=rows, **kwargs)

    fsdp.make_weight, fsdp.draws_blockwise = recording, lambda spec, device: True
    try:
        results = [run_on_rank(ctx, CaseSpec.parse(case_id)) for _ in range(2)]
    finally:
        fsdp.make_weight, fsdp.draws_blockwise = make_weight, blockwise
    return asked, results


def test_the_second_case_draws_only_its_rows_and_gathers_as_the_first():
    """The second case finds the golden kept and draws only its shard's rows; a route that reads only
    those gathers what the first case did."""
    from qgather.runtime import PoolSpec, get_pool

    case_id = "tests._own_route_adapters:OwnRowsOnly:fp8_tensor:128x64:bf16:ws2:gather:s0"
    outcome = get_pool(PoolSpec("gloo", 2, "cpu")).run(gather_twice, case_id, timeout=120)
    assert outcome.status == "ok", outcome.summary()
    for rank, (asked, (first, second)) in enumerate(outcome.results):
        assert asked == [None, (64 * rank, 64 * rank + 64)]
        assert first.stages[0].digest and not first.stages[0].buffer_diffs, first.stages[0]
        assert second.stages == first.stages


def test_a_route_that_reads_rows_it_did_not_draw_fails_loudly():
    """A route that says it reads only its rows but quantizes the full master meets NaN in the
    second case (never an identical weight an earlier case left in memory)."""
    from qgather.runtime import PoolSpec, get_pool

    case_id = "tests._own_route_adapters:ClaimsOwnRowsOnly:fp8_tensor:128x64:bf16:ws2:gather:s0"
    outcome = get_pool(PoolSpec("gloo", 2, "cpu")).run(gather_twice, case_id, timeout=120)
    assert outcome.status == "error" and "NaN" in outcome.summary(), outcome.summary()


def test_only_routes_that_read_their_own_rows_say_so():
    from qgather.impls.te.route import DelayedScalingRoute, TransformerEngineRoute

    assert TransformerEngineRoute.reads_own_rows_only and DelayedScalingRoute.reads_own_rows_only
    assert not ReferenceImplementation.reads_own_rows_only
