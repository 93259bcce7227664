"""A rank keeps a case's first golden for the later cases of the same weight (qgather.check.golden_cache):
the second case reuses it, across world sizes' configurations, and judges exactly as the first did."""

from __future__ import annotations

import torch

from qgather.check.golden import Golden
from qgather.check.golden_cache import GoldenCache, GoldenKey
from qgather.formats import QuantizedTensor
from qgather.model.case import CaseSpec


def run_twice(ctx, case_ids: list[str]) -> tuple[list, int, int]:
    """On a pool rank: each case in turn, from a fresh golden cache; the results, its hits and misses."""
    from qgather.check.golden_cache import kept_in
    from qgather.scenarios.registry import run_on_rank

    ctx.kept.clear()  # whatever earlier tests' cases on this pool kept
    results = [run_on_rank(ctx, CaseSpec.parse(case_id)) for case_id in case_ids]
    cache = kept_in(ctx.kept)
    return results, cache.hits, cache.misses


def test_a_second_case_of_the_same_weight_reuses_the_golden_and_judges_alike():
    from qgather.runtime import PoolSpec, get_pool

    mutant = "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0"
    ids = [mutant, mutant + ":mp-bf16", mutant.replace(":s0", ":s1")]  # a configuration shares it, a seed not
    outcome = get_pool(PoolSpec("gloo", 2, "cpu")).run(run_twice, ids, timeout=120)
    assert outcome.status == "ok", outcome.summary()
    for results, hits, misses in outcome.results:
        assert (hits, misses) == (1, 2)
        first, again, other_seed = results
        assert first.stages[0].buffer_diffs and first.stages[0].where  # the mutant's evidence
        # the same evidence from the kept golden: which buffer, how many elements, which rows
        assert again.stages[0].buffer_diffs == first.stages[0].buffer_diffs
        assert again.stages[0].where == first.stages[0].where
        assert other_seed.stages[0].digest != first.stages[0].digest


def twins_built(ctx, case_ids: list[str]) -> tuple[list, int]:
    """On a pool rank: each case in turn from a fresh cache; the results and the twins built."""
    from tests._own_route_adapters import WithTwin

    ctx.kept.clear()
    before = WithTwin.twins_built
    results = run_twice(ctx, case_ids)[0]
    return results, WithTwin.twins_built - before


def test_a_second_case_of_the_same_weight_and_configuration_reuses_the_twins_output():
    from qgather.runtime import PoolSpec, get_pool

    case = "tests._own_route_adapters:WithTwin:nvfp4_2d:128x64:bf16:ws2:gather:s0"
    outcome = get_pool(PoolSpec("gloo", 2, "cpu")).run(twins_built, [case, case, case + ":mp-fp32"], timeout=120)
    assert outcome.status == "ok", outcome.summary()
    for results, built in outcome.results:
        assert built == 2  # the first case's twin served the second; another compute dtype needs its own
        first, again = (r.stages[0].module for r in results[:2])
        assert first.output.equal and again == first, (first, again)  # the kept output, compared alike


def _golden(nbytes: int) -> Golden:
    return Golden(QuantizedTensor("fp8_tensor", (nbytes,), {"data": torch.zeros(nbytes, dtype=torch.uint8)}, {}),
                  None)


def test_the_cache_is_bounded_and_keeps_no_error():
    spec = CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s0")
    keys = [GoldenKey.of(spec, torch.device("cpu")), GoldenKey.of(spec, torch.device("meta")),
            GoldenKey.of(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws4:steps:s0"), torch.device("cuda:0"))]
    cache = GoldenCache(max_entries=2, max_bytes=100)
    kept = cache.get(keys[0], lambda: _golden(10))
    assert cache.get(keys[0], lambda: _golden(10)) is kept and (cache.hits, cache.misses) == (1, 1)
    cache.get(keys[1], lambda: _golden(10))
    cache.get(keys[2], lambda: _golden(10))  # the third entry lets the least recently used go
    assert len(cache) == 2 and cache.get(keys[0], lambda: _golden(10)) is not kept
    cache.get(keys[1], lambda: _golden(200))  # larger than the cache: computed, not kept
    cache.get(keys[1], lambda: Golden(None, "cannot hold"))
    assert cache.get(keys[1], lambda: _golden(5)).nbytes == 5


def test_a_forgotten_cache_computes_the_golden_again():
    from qgather.check.golden_cache import forget, kept_in

    kept: dict = {}
    key = GoldenKey.of(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s0"), torch.device("cpu"))
    first = kept_in(kept).get(key, lambda: _golden(10))
    assert kept_in(kept).get(key, lambda: _golden(10)) is first
    forget(kept)
    forget(kept)  # nothing kept: nothing to do
    assert kept_in(kept).get(key, lambda: _golden(10)) is not first and kept_in(kept).misses == 1


def test_the_layer_input_is_drawn_once_per_seed_and_k():
    from qgather.scenarios.data import make_input

    cache, drawn = GoldenCache(), []

    def draw(spec):
        drawn.append(spec.id)
        return make_input(spec)

    first = cache.layer_input(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s0"), draw)
    again = cache.layer_input(CaseSpec.parse("reference:nvfp4_2d:256x64:bf16:ws4:steps:s0"), draw)  # same seed, K
    other = cache.layer_input(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s1"), draw)
    assert again is first and len(drawn) == 2
    assert torch.equal(first, make_input(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s0")))
    assert not torch.equal(other, first)


def test_a_buffer_identical_to_the_golden_takes_the_goldens_digest_part(monkeypatch):
    """On a device, digest fingerprints large buffers; a gathered buffer bit-identical to the golden
    (same shape and dtype) hashes as the golden's, computed once. Here CPU buffers of 64 elements or
    more are fingerprinted as a device's would be: the digest is the same as computed from scratch."""
    from qgather.check.golden import golden_for
    from qgather.check.inspection import _identical
    from qgather.formats import FORMATS
    from qgather.instruments import compare, digest

    monkeypatch.setattr(digest, "is_fingerprinted", lambda region: region.numel() >= 64)
    golden = golden_for(FORMATS["nvfp4_2d"], torch.randn(128, 64, generator=torch.Generator().manual_seed(0)))
    got = {name: t.clone() for name, t in golden.q.buffers.items()}
    got["columnwise_data"][3, 5] ^= 1
    diffs = compare.compare_buffers(got, golden.q)
    identical = _identical(got, golden, diffs)
    assert sorted(identical) == ["amax_columnwise", "amax_rowwise", "columnwise_scale_inv", "rowwise_data",
                                 "rowwise_scale_inv"]  # small ones too: their bytes hash as the golden's
    parts = golden.digest_parts(identical)
    assert digest.digest(got, golden.q.valid, parts) == digest.digest(got, golden.q.valid)
    # the next case's gather, all identical: the kept parts serve it, the one missing is added
    again = {name: t.clone() for name, t in golden.q.buffers.items()}
    kept = golden.digest_parts(_identical(again, golden, compare.compare_buffers(again, golden.q)))
    assert kept == parts | {"columnwise_data": digest.digest_part("columnwise_data", again["columnwise_data"],
                                                                   golden.q.valid)}
    assert digest.digest(again, golden.q.valid, kept) == digest.digest(again, golden.q.valid)
    got["rowwise_data"] = got["rowwise_data"].view(torch.int8)  # same bits, another dtype: not the golden's part
    assert "rowwise_data" not in _identical(got, golden, compare.compare_buffers(got, golden.q))


def test_a_kept_golden_holds_a_derived_buffer_as_a_view_only_where_its_bits_agree():
    from qgather.check.golden import golden_for
    from qgather.formats import FORMATS

    fmt = FORMATS["fp8_block"]
    golden = golden_for(fmt, torch.randn(256, 384, generator=torch.Generator().manual_seed(3)))
    rowwise = golden.q.buffers["rowwise_data"]
    golden.keep_on_device()
    assert golden.q.buffers["columnwise_data"].data_ptr() == rowwise.data_ptr()  # one copy
    assert golden.q.buffers["columnwise_data"].equal(rowwise.t())

    broken = golden_for(fmt, torch.randn(256, 384, generator=torch.Generator().manual_seed(3)))
    broken.q.buffers["columnwise_data"][5, 9] ^= 1  # e.g. an own quantizer's columnwise copy that differs
    broken.keep_on_device()
    assert broken.q.buffers["columnwise_data"].data_ptr() != broken.q.buffers["rowwise_data"].data_ptr()
    assert int(broken.q.buffers["columnwise_data"][5, 9]) != int(broken.q.buffers["rowwise_data"][9, 5])


def test_a_golden_kept_as_one_copy_is_not_compared_again(monkeypatch):
    from qgather.check import golden as golden_module
    from qgather.formats import FORMATS

    golden = golden_module.golden_for(FORMATS["fp8_block"], torch.randn(256, 128))
    golden.keep_on_device()
    calls = []
    monkeypatch.setattr(golden_module, "compare_buffers", lambda *a: calls.append(a) or [])
    golden.keep_on_device()  # the next case of this weight: the view is already held
    assert calls == []


def test_the_golden_layer_output_is_kept_for_the_same_input_only():
    from qgather.check.golden import golden_for
    from qgather.formats import FORMATS

    golden = golden_for(FORMATS["nvfp4_2d"], torch.randn(64, 64))
    x, y = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64)
    golden.keep_output(x, False, y)
    output, differing = golden.kept_output(x.clone(), False)
    assert torch.equal(output, y) and int(differing) == 0
    assert golden.kept_output(x, True) is None  # computed block by block: other GEMM shapes
    assert golden.kept_output(x.float(), False) is None
    other = x.clone()
    other[3, 5] += 1
    assert int(golden.kept_output(other, False)[1]) == 1  # said by a count the caller reads with its own
    golden.replace_buffers({"amax_rowwise": golden.q.buffers["amax_rowwise"] * 2})  # other values
    assert golden.kept_output(x, False) is None


def test_each_case_gets_its_own_copy_of_the_kept_layer_input():
    """A library's forward that wrote into its input must not change the next case's."""
    from types import SimpleNamespace

    from qgather.model.phases import PhaseTracker
    from qgather.scenarios.context import RankCase

    ctx = SimpleNamespace(kept={}, device=torch.device("cpu"), mesh=None, rank=0, world_size=2)
    spec = CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s0")
    first = RankCase.prepare(ctx, spec, PhaseTracker())
    first.x.zero_()
    second = RankCase.prepare(ctx, spec, PhaseTracker())
    assert second.x.abs().sum() > 0 and second.x.data_ptr() != first.x.data_ptr()


def test_an_output_bit_identical_to_the_kept_golden_output_takes_its_digest(monkeypatch):
    """The inspection's output digest of an output equal bit for bit to the golden layer's is the
    kept output's, computed once (no copy of the output to the host per case); another output is
    digested itself."""
    from qgather.check import inspection
    from qgather.check.golden import golden_for
    from qgather.formats import FORMATS
    from qgather.impls import get_impl
    from qgather.instruments import digest
    from qgather.model.case import CaseSpec, ShardLayout

    spec = CaseSpec.parse("reference:fp8_tensor:64x32:bf16:ws2:gather:s0")
    golden = golden_for(FORMATS["fp8_tensor"], torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    inspector = inspection.Inspector(spec, get_impl("reference"), FORMATS["fp8_tensor"], x, ShardLayout(64, 2, 1))
    weight = golden.dequantized_as(torch.float32)
    exact, exact_digest, _ = inspector._forward(weight, golden)
    assert exact.equal and exact_digest == digest.digest({"output": golden.kept_output(x, False)[0]}, {})
    digested = []
    for module in (inspection, digest):
        monkeypatch.setattr(module, "digest", lambda *a, real=digest.digest: digested.append(a) or real(*a))
    assert inspector._forward(weight, golden)[1] == exact_digest and not digested  # kept: nothing digested
    off = weight.clone()
    off[0, 0] = off[0, 0] * 2 + 1
    wrong, wrong_digest, _ = inspector._forward(off, golden)
    assert not wrong.equal and wrong_digest != exact_digest and len(digested) == 1
