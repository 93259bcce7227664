"""Classification rules on synthetic rank results (the end-to-end paths are in test_engine.py)."""

from dataclasses import replace

from qgather.engine.classify import classify_errors, classify_results
from qgather.impls.rejections import DeclaredRejections
from qgather.model.case import CaseSpec
from qgather.model.policy import expectation
from qgather.model.records import BufferDiff, Comparison, DiffProblem, ModuleCheck, RankResult, Stage, WireSummary
from qgather.model.verdict import Verdict
from qgather.runtime import RankError


def classify(results):
    found = classify_results(results)
    return found.verdict, found.reason, list(found.details)


def classify_err(errors, world_size, declared=frozenset()):
    found = classify_errors(errors, world_size, DeclaredRejections.of(declared).problem)
    return found.verdict, found.reason, list(found.details)

SPEC = CaseSpec("reference", "nvfp4_2d", (128, 64), "bf16", 2, "gather")


def stage(digest="d0", diffs=(), output_equal=True, quantized=True):
    return Stage("unshard 1", quantized, digest, tuple(diffs), dequantized=Comparison(not diffs, len(diffs)),
                 output=Comparison(output_equal, 0 if output_equal else 3, 0.5), output_digest="y0")


def wire(**kw):
    base = {"collective_bytes": 4608, "collectives": 1, "hook_calls": 1, "hook_outputs": [],
            "high_precision_elements": 0, "shard_numel": 4096, "param_itemsize": 2, "packed_bytes": 4608}
    return WireSummary(**{**base, **kw})


def results(*stages_per_rank, **wire_kw):
    return [RankResult(r, [s], wire(**wire_kw)) for r, s in enumerate(stages_per_rank)]


def test_identical_exact_ranks_are_exact():
    verdict, reason, details = classify(results(stage(), stage()))
    assert verdict is Verdict.EXACT and "1.00x the packed shard size" in details[0]


def test_ranks_that_disagree_are_divergent_and_grouped():
    verdict, _, details = classify(results(stage("a"), stage("b")))
    assert verdict is Verdict.RANK_DIVERGENCE and "[0]; [1]" in details[0]


def test_agreeing_ranks_that_differ_from_golden_are_silent_mismatch():
    diff = BufferDiff("rowwise_scale_inv", DiffProblem.BITS, n_diff=3, n_valid=1024)
    verdict, reason, _ = classify(results(stage(diffs=[diff]), stage(diffs=[diff])))
    assert verdict is Verdict.SILENT_MISMATCH and "rowwise_scale_inv: 3 of 1024 valid elements differ" in reason


def test_output_difference_alone_is_a_mismatch():
    verdict, _, _ = classify(results(stage(output_equal=False), stage(output_equal=False)))
    assert verdict is Verdict.SILENT_MISMATCH


def test_high_precision_on_the_wire_is_degraded_even_when_values_match():
    verdict, reason, _ = classify(results(stage(), stage(), high_precision_elements=4096))
    assert verdict is Verdict.DEGRADED and "high-precision" in reason
    verdict, reason, _ = classify(results(stage(), stage(), hook_calls=0, collective_bytes=8192))
    assert verdict is Verdict.DEGRADED and "no pre-all-gather hook" in reason


def test_plain_tensor_after_gather_is_degraded():
    plain = Stage("unshard 1", quantized=False, digest="v", values=Comparison(True))
    verdict, _, _ = classify(results(plain, plain))
    assert verdict is Verdict.DEGRADED


def test_quantizer_disagreement_is_reported_after_an_exact_gather():
    diff = BufferDiff("scale_inv", DiffProblem.BITS, n_diff=1, n_valid=1)
    res = [replace(r, quantizer=(diff,)) for r in results(stage(), stage())]
    verdict, _, details = classify(res)
    assert verdict is Verdict.QUANTIZER_MISMATCH and details == ["scale_inv: 1 of 1 valid elements differ"]


DECLARED = frozenset({"ShardAlignmentError"})


def refusal(rank: int, message: str, phase: str = "shard", type_name: str = "ShardAlignmentError") -> RankError:
    return RankError(rank, type_name, message, "", phase, (type_name, "ValueError", "Exception"))


def test_same_error_everywhere_is_rejected_partial_is_error():
    message = "shard of 17 rows is not a multiple of 16"
    verdict, reason, _ = classify_err({0: refusal(0, message), 1: refusal(1, message)}, 2, DECLARED)
    assert verdict is Verdict.REJECTED and "multiple of 16" in reason
    verdict, reason, details = classify_err({1: RankError(1, "AssertionError", "padded", "tb")}, 2)
    assert verdict is Verdict.ERROR and reason.startswith("rank 1 raised AssertionError")
    assert any("ranks 0 did not raise" in d for d in details)


def test_policy():
    aligned = expectation(SPEC)
    assert aligned.aligned and aligned.accepts(Verdict.EXACT) and not aligned.accepts(Verdict.REJECTED)
    split = expectation(CaseSpec("reference", "nvfp4_2d", (136, 64), "bf16", 8, "gather"))
    assert not split.aligned and split.accepts(Verdict.REJECTED) and "row 17" in split.reason
    assert not split.accepts(Verdict.SILENT_MISMATCH)
    unholdable = expectation(CaseSpec("reference", "nvfp4_2d", (128, 40), "bf16", 2, "gather"))
    assert not unholdable.aligned and "nvfp4_2d" in unholdable.reason


def test_an_internal_fault_on_every_rank_is_an_error_not_a_rejection():
    message = "'NoneType' object has no attribute 'dtype'"
    errors = {r: RankError(r, "AttributeError", message, "") for r in (0, 1)}
    verdict, _, details = classify_err(errors, 2)
    assert verdict is Verdict.ERROR and any("internal fault" in d for d in details)


def test_an_unpacking_fault_on_every_rank_is_an_error_not_a_rejection():
    # Seen with TE's blockwise post-hook at world size 1, where FSDP2 hands it one output of two.
    errors = {0: RankError(0, "ValueError", "not enough values to unpack (expected 2, got 1)", "")}
    verdict, _, details = classify_err(errors, 1)
    assert verdict is Verdict.ERROR and any("internal fault" in d for d in details)


def test_every_rank_naming_its_own_shard_size_is_one_rejection():
    errors = {r: refusal(r, f"FSDP2 requires shard_M ({m}) to be a multiple of 16", "pre-all-gather hook",
                         "AssertionError") for r, m in ((0, 46), (1, 46), (2, 44))}
    verdict, reason, details = classify_err(errors, 3, frozenset({"AssertionError"}))
    assert verdict is Verdict.REJECTED and "shard_M (46)" in reason
    assert "rank 2: AssertionError: FSDP2 requires shard_M (44) to be a multiple of 16" in details


def test_ranks_raising_different_errors_are_an_error():
    declared = frozenset({"AssertionError", "RuntimeError"})
    errors = {0: refusal(0, "shard_M (46) is not a multiple of 16", type_name="AssertionError"),
              1: refusal(1, "shard_M (46) is not a multiple of 16", type_name="RuntimeError")}
    assert classify_err(errors, 2, declared)[0] is Verdict.ERROR
    errors[1] = refusal(1, "scale rows do not match", type_name="AssertionError")
    assert classify_err(errors, 2, declared)[0] is Verdict.ERROR


def test_only_a_declared_type_raised_before_data_moved_is_a_rejection():
    message = "shard of 17 rows is not a multiple of 16"
    both = {r: refusal(r, message) for r in (0, 1)}
    assert classify_err(both, 2, DECLARED)[0] is Verdict.REJECTED
    verdict, _, details = classify_err(both, 2, frozenset())  # nothing declared
    assert verdict is Verdict.ERROR and any("declared rejection types" in d for d in details)
    late = {r: refusal(r, message, phase="post-all-gather hook") for r in (0, 1)}
    verdict, _, details = classify_err(late, 2, DECLARED)
    assert verdict is Verdict.ERROR and any("not before any data moved" in d for d in details)
    unknown = {r: refusal(r, message, phase="") for r in (0, 1)}
    assert classify_err(unknown, 2, DECLARED)[0] is Verdict.ERROR


def test_a_broad_type_is_a_rejection_only_with_its_declared_message():
    declared = frozenset({"AssertionError: FSDP2 requires"})
    ours = {r: refusal(r, "FSDP2 requires shard_M (46) to be a multiple of 16", "pre-all-gather hook",
                       "AssertionError") for r in (0, 1)}
    assert classify_err(ours, 2, declared)[0] is Verdict.REJECTED
    fsdp2 = {r: refusal(r, "Invalid fsdp_pre_all_gather: (mesh, orig_size)", "shard", "AssertionError")
             for r in (0, 1)}
    assert classify_err(fsdp2, 2, declared)[0] is Verdict.ERROR


def with_module(check):
    return replace(stage(), module=check)


def test_library_forward_differing_from_its_one_device_twin_is_a_mismatch():
    wrong = ModuleCheck(output=Comparison(False, 5, 0.25))
    verdict, reason, details = classify(results(with_module(ModuleCheck(Comparison(True))),
                                                              with_module(wrong)))
    assert verdict is Verdict.SILENT_MISMATCH and "on ranks 1" in reason and "5 output elements" in details[0]


def test_library_forward_raising_only_when_sharded_is_an_error():
    verdict, reason, details = classify(results(with_module(ModuleCheck(error="RuntimeError: x")),
                                                              with_module(ModuleCheck(error="RuntimeError: x"))))
    assert verdict is Verdict.ERROR and "not on one device" in reason and "RuntimeError: x" in details[0]


def test_a_shape_the_one_device_module_cannot_run_is_a_note_on_an_exact_case():
    note = ModuleCheck(note="the one-device module cannot run this case either: AssertionError: dims")
    verdict, _, details = classify(results(with_module(note), with_module(note)))
    assert verdict is Verdict.EXACT and any("library forward not compared" in d for d in details)
    verdict, _, details = classify(results(with_module(ModuleCheck(Comparison(True))),
                                                         with_module(ModuleCheck(Comparison(True)))))
    assert verdict is Verdict.EXACT and any("bit-identical to the same module on one device" in d for d in details)


def test_a_checkpoint_save_that_crashes_keeps_every_ranks_stacks_like_any_case(monkeypatch, tmp_path):
    """engine.checkpoint judges the save's outcome with the one classify_outcome: the CRASH of the
    save at world size A carries the ranks' stacks, as a CRASH of the case itself does."""
    from qgather.engine import checkpoint
    from qgather.engine.run import RunOptions
    from qgather.impls import get_impl
    from qgather.runtime import CaseOutcome, OutcomeStatus

    stack = 'Thread 0x1 (most recent call first):\n  File "/x/mylib/hooks.py", line 7 in pre_all_gather\n'
    crashed = CaseOutcome(OutcomeStatus.CRASH, [None, None], exit_codes={1: -11}, stacks={0: stack})

    class Pool:
        def run(self, *args, **kwargs):
            return crashed

    monkeypatch.setattr(checkpoint, "get_pool", lambda spec, say=None: Pool())
    spec = CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws3:gather:s0:dcp-ws2")
    path, found, outcome = checkpoint._save(spec, get_impl("reference"), RunOptions(device="cpu"), str(tmp_path))
    assert path is None and found.verdict is Verdict.CRASH and outcome is crashed
    assert found.reason == f"checkpoint save at world size 2: {crashed.headline()}"
    assert found.details == ("rank 0 stack (innermost first):", "  pre_all_gather (x/mylib/hooks.py:7)")
