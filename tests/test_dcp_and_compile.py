"""The dcp-wsA and compile configurations (qgather.scenarios.checkpoint, qgather.scenarios.compiled):
each would fail if the scenarios ignored the dimension (the zoo's mutants for it are caught only
when the checkpoint really is saved at A and loaded at B, or the forward really is compiled)."""

from __future__ import annotations

import glob
import os
import tempfile

import torch

from qgather.model.case import CaseSpec
from qgather.model.policy import expectation
from qgather.model.verdict import Verdict
from qgather.scenarios.checkpoint import initial_master, saved_spec
from qgather.scenarios.data import make_weight
from qgather.tools import selftest

DCP = "fp8_tensor:128x64:bf16:ws2:gather:s0:dcp-ws4"
COMPILED = "fp8_tensor:128x64:bf16:ws2:gather:s0:compile"


def test_a_loading_module_starts_from_another_weight_and_amax():
    spec = CaseSpec.parse(f"reference:{DCP}")
    master = make_weight(spec)
    decoy = initial_master(spec, master)
    assert decoy.shape == master.shape and decoy.abs().amax() != master.abs().amax()
    assert initial_master(CaseSpec.parse("reference:fp8_tensor:128x64:bf16:ws2:gather:s0"), master) is master
    assert saved_spec(spec).id == "reference:fp8_tensor:128x64:bf16:ws4:gather:s0"


def test_the_expectation_holds_the_saving_world_size_too():
    # 48 nvfp4 rows: 24-row shards at 2 ranks split a 16-row block, 12 at 4; aligned at 1 and 3
    assert expectation(CaseSpec.parse("reference:nvfp4_2d:48x64:bf16:ws3:gather:s0")).aligned
    saved_at_2 = expectation(CaseSpec.parse("reference:nvfp4_2d:48x64:bf16:ws3:gather:s0:dcp-ws2"))
    assert not saved_at_2.aligned and "at world size 2" in saved_at_2.reason
    assert expectation(CaseSpec.parse("reference:nvfp4_2d:48x64:bf16:ws3:gather:s0:dcp-ws1")).aligned


def test_resharded_checkpoint_is_exact_and_a_lost_scale_is_caught():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"qgather-pool-{os.getpid()}-dcp-*")))
    reference = selftest.run(f"reference:{DCP}")
    assert reference.verdict is Verdict.EXACT, reference.render()
    assert any("saved at world size 4 (4 .distcp files)" in d for d in reference.details), reference.details
    mutant = selftest.run(f"mutant:checkpoint_drops_scale:{DCP}")
    assert mutant.verdict is Verdict.SILENT_MISMATCH and "scale_inv" in mutant.reason, mutant.render()
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), f"qgather-pool-{os.getpid()}-dcp-*")))
    assert after == before, "a checkpoint directory outlived its case"


def test_a_rank_without_rows_takes_the_loaded_scale():
    """A checkpoint loads nothing onto a rank that holds no rows (1 row over 3 ranks): the reference
    gathers with rank 0's per-tensor scale; a subclass using its own stale one diverges there, and
    only there (46 rows over 3 ranks, the sweep's uneven shape before the regimes: every rank holds rows)."""
    empty = "fp8_tensor:1x16:bf16:ws3:gather:s0:dcp-ws1"
    assert selftest.run(f"reference:{empty}").verdict is Verdict.EXACT
    mutant = selftest.run(f"mutant:empty_shard_stale_scale:{empty}")
    assert mutant.verdict is Verdict.RANK_DIVERGENCE and "[0]; [1,2]" in mutant.render(), mutant.render()
    held = "fp8_tensor:46x64:bf16:ws3:gather:s0:dcp-ws1"
    assert selftest.run(f"mutant:empty_shard_stale_scale:{held}").verdict is Verdict.EXACT


def test_compiled_forward_is_bitwise_and_an_unflatten_that_drops_the_scale_is_caught():
    reference = selftest.run(f"reference:{COMPILED}")
    assert reference.verdict is Verdict.EXACT, reference.render()
    assert any("torch.compile backend aot_eager, 1 graph(s)" in d for d in reference.details), reference.details
    mutant = selftest.run(f"mutant:unflatten_drops_scale:{COMPILED}")
    assert mutant.verdict is Verdict.SILENT_MISMATCH and "compiled forward" in mutant.reason, mutant.render()


def test_reference_subclass_round_trips_flatten_and_weights_only_load(tmp_path):
    from qgather.impls import get_impl

    param = get_impl("reference").make_param("nvfp4_1d", torch.randn(32, 64).to(torch.bfloat16))
    names, meta = param.__tensor_flatten__()
    rebuilt = type(param).__tensor_unflatten__({n: getattr(param, n) for n in names}, meta, param.shape, None)
    assert torch.equal(rebuilt.float(), param.float())
    torch.save(param, tmp_path / "p.pt")
    loaded = torch.load(tmp_path / "p.pt", weights_only=True)
    assert type(loaded) is type(param) and torch.equal(loaded.float(), param.float())


class _Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_compiled_call_that_runs_no_compiled_graph_is_an_error_not_a_pass():
    """A case compiles once and calls the compiled module at every point (qgather.scenarios.compiled):
    a later call Dynamo runs eagerly (here: a failed guard past the recompile limit) tested nothing."""
    from types import SimpleNamespace

    from qgather.model.config import FsdpConfig
    from qgather.scenarios.compiled import NO_GRAPH_RAN, CaseForward

    case = SimpleNamespace(spec=SimpleNamespace(config=FsdpConfig(compile=True)))
    torch._dynamo.reset()  # nothing warm from an earlier test of this process
    forward = CaseForward(case, _Twice())
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 1
    try:
        calls = forward.counting.calls
        forward(torch.randn(2, 4))
        assert forward.problem() is None and forward.graphs == 1
        forward(torch.randn(2, 4))  # the same guards: the graph traced for the first call runs again
        assert forward.problem() is None and (forward.graphs, forward.counting.calls - calls) == (1, 2)
        assert torch.equal(forward(torch.ones(2, 4, dtype=torch.float64)), torch.full((2, 4), 2.0, dtype=torch.float64))
        assert forward.problem() == NO_GRAPH_RAN  # a float64 input fails the guard; no recompile is allowed
        stage, = forward.outputs_stage("outputs", "module", torch.zeros(1), torch.zeros(1))
        assert stage.forward_error == NO_GRAPH_RAN
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()


def test_a_later_case_runs_the_graph_an_earlier_one_compiled():
    """The rank's warm compiles (qgather.scenarios.compiled.WarmCompiles): a second case's module of the
    same structure and inputs runs the first case's graph, tracing nothing, and that counts as compiled."""
    from types import SimpleNamespace

    from qgather.model.config import FsdpConfig
    from qgather.scenarios.compiled import WARM, CaseForward

    case = SimpleNamespace(spec=SimpleNamespace(config=FsdpConfig(compile=True)))
    WARM.counting = None  # a fresh start, as a new rank's
    first = CaseForward(case, _Twice())
    first(torch.randn(2, 4))
    second = CaseForward(case, _Twice())
    out = second(torch.randn(2, 4))
    assert (first.graphs, second.graphs) == (1, 0) and second.problem() is None and out.shape == (2, 4)
    assert second.counting is first.counting
    WARM.cases = WARM.RESET_EVERY  # the next case resets Dynamo's caches and starts a new backend
    third = CaseForward(case, _Twice())
    assert third.counting is not first.counting and third.counting.graphs == 0
    torch._dynamo.reset()


def test_a_new_shape_compiles_a_static_graph_whatever_ran_before():
    """A warm rank recompiles a static graph for each new shape (automatic dynamic shapes off): a third
    shape is traced again, where a dynamic graph made at the second would have served it."""
    from types import SimpleNamespace

    from qgather.model.config import FsdpConfig
    from qgather.scenarios.compiled import WARM, CaseForward

    case = SimpleNamespace(spec=SimpleNamespace(config=FsdpConfig(compile=True)))
    WARM.counting = None
    graphs = []
    for rows in (2, 3, 5):
        forward = CaseForward(case, _Twice())
        forward(torch.randn(rows, 4))
        graphs.append(forward.graphs)
    assert graphs == [1, 1, 1]
    torch._dynamo.reset()


def test_the_reference_dequantization_is_one_node_of_a_compiled_graph():
    """qgather.impls.reference.traced: torch.compile traces the reference's dequantization as one op
    (not its dozen tensor ops, once per trace pass), and the compiled output is the eager one bit for bit."""
    from torch._dynamo.backends.common import aot_autograd

    from qgather.impls import get_impl
    from qgather.scenarios.module import QuantizedLinear

    impl = get_impl("reference")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for fmt in ("nvfp4_2d", "fp8_block"):
        module = QuantizedLinear(impl, impl.make_param(fmt, torch.randn(3, 128, 64).to(torch.bfloat16)))
        x = torch.randn(3, 4, 64, dtype=torch.bfloat16)
        torch._dynamo.reset()
        out = torch.compile(module, backend=aot_autograd(fw_compiler=backend))(x)
        assert torch.equal(out.view(torch.int16), module(x).view(torch.int16)), fmt
        targets = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
        assert targets.count("qgather.dequantize_row_layout.default") == 1, targets
        inputs = [n for n in graphs[-1].graph.nodes if n.op == "placeholder"]
        readers = {str(user.target) for n in inputs[:-1] for user in n.users}  # the weight's inner tensors
        assert readers == {"qgather.dequantize_row_layout.default"}, readers
    torch._dynamo.reset()


def test_the_dequantization_op_never_returns_a_view_of_its_inputs():
    """A format of one's own may dequantize to a view of its storage; a custom op's output may not alias
    its inputs, so the op copies it."""
    from qgather.formats import FORMATS
    from qgather.impls.reference.traced import dequantized, through_op

    class Plain(type(FORMATS["fp8_tensor"])):
        def _dequantize_row_layout(self, rows, glob, shape):
            return rows["data"].view(torch.float32)  # four uint8 bytes a float32: a view, not a copy

        def row_specs(self, shape):
            return {"data": ((shape[0], shape[1] * 4), torch.uint8)}

    fmt = Plain("plain_view", torch.float8_e4m3fn, 448.0)
    data = torch.arange(32, dtype=torch.uint8).reshape(2, 16)
    out = through_op(fmt, {"data": data}, {"scale_inv": torch.ones(1)}, (2, 4))
    assert torch.equal(out, data.view(torch.float32))
    assert out.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()
    assert torch.equal(dequantized(fmt, {"data": data}, {"scale_inv": torch.ones(1)}, (2, 4)), out)  # eager: direct


def test_a_compiled_case_forward_leaves_the_guards_untimed_and_the_patch_undone():
    """qgather.instruments.patches.guard_latency_unmeasured: inside a compiled case's call Dynamo builds
    its guards but does not time them (torch's cache-flushing measurement, a log line's worth); outside
    it, torch's own function is back."""
    from types import SimpleNamespace

    import torch._dynamo.guards as guards

    from qgather.model.config import FsdpConfig
    from qgather.scenarios.compiled import CaseForward

    original, timed = guards.profile_guard_manager, []

    def spy(*args):
        timed.append(args)
        return original(*args)

    guards.profile_guard_manager = spy
    try:
        case = SimpleNamespace(spec=SimpleNamespace(config=FsdpConfig(compile=True)))
        torch._dynamo.reset()
        forward = CaseForward(case, _Twice())
        assert torch.equal(forward(torch.ones(3, 2)), torch.full((3, 2), 2.0)) and forward.graphs == 1
        assert timed == [] and guards.profile_guard_manager is spy
        torch._dynamo.reset()
        torch.compile(_Twice(), backend="eager")(torch.ones(3, 2))  # outside a case's call: timed as ever
        assert len(timed) == 1
    finally:
        guards.profile_guard_manager = original
        torch._dynamo.reset()
