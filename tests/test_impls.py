"""Loading implementations without editing qgather (package.module:object and entry points), the refusal
of an incomplete adapter at load, and declared rejection types matched by class."""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from qgather import errors, impls
from qgather.errors import AdapterError, UsageError
from qgather.formats import FormatError
from qgather.impls import AdapterLoadError, UnknownImplementationError, base, get_impl
from qgather.impls.base import Implementation, missing_methods
from qgather.impls.reference import ReferenceImplementation
from qgather.impls.reference import ShardAlignmentError as ReferenceShardAlignmentError
from qgather.impls.te.quantizers import TEUnavailable
from qgather.model.case import SCENARIOS


@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """A tiny installed distribution that registers an adapter in the qgather.impls group."""
    (tmp_path / "myqlib.py").write_text(textwrap.dedent("""
        from qgather.impls.reference import ReferenceImplementation

        class MyImpl(ReferenceImplementation):
            name = "myqlib"
            formats = ("nvfp4_2d",)
    """))
    dist = tmp_path / "myqlib-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myqlib\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[qgather.impls]\nmyqlib = myqlib:MyImpl\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(impls, "_CACHE", {})
    yield
    sys.modules.pop("myqlib", None)


def test_entry_point_registers_by_name(plugin_package):
    impl = get_impl("myqlib")
    assert isinstance(impl, ReferenceImplementation) and impl.formats == ("nvfp4_2d",)
    assert "myqlib" in impls.available()


def test_module_object_path(plugin_package):
    impl = get_impl("myqlib:MyImpl")
    assert type(impl).__name__ == "MyImpl"


@pytest.mark.parametrize("name, words", [
    ("nosuch", "unknown implementation 'nosuch'"),
    ("no.such.module:Impl", "cannot load it"),
    ("qgather.model.case:CaseSpec", "not a qgather.impls.base.Implementation"),
])
def test_bad_names_say_why(name, words):
    with pytest.raises(UnknownImplementationError) as info:
        get_impl(name)
    assert words in str(info.value)


# ------------------------------------------------------------------ incomplete adapters are refused at load
INCOMPLETE = '''
import torch
from qgather.impls.base import Implementation

class NoReader(Implementation):                 # read_buffers missing
    formats = ("fp8_tensor",)
    def make_param(self, fmt, weight): return weight
    def requantize_shard(self, local, master_rows, group): pass
    def is_quantized(self, param): return True

class NoRoute(Implementation):                  # neither make_param nor make_sharded_module
    scenarios = ("gather",)
    def read_buffers(self, param): return {}
    def is_quantized(self, param): return True

class OwnRouteOnly(Implementation):             # its own route, and the scenarios that need no more
    scenarios = ("gather", "steps")
    def make_sharded_module(self, ctx, spec, master, setup=None): return None
    def read_buffers(self, param): return {}
    def requantize_shard(self, local, master_rows, group): pass
    def is_quantized(self, param): return True

class OwnRouteWithHooks(OwnRouteOnly):          # the hooks scenario builds the parameter itself
    scenarios = ("gather", "hooks")

class ModelLater(OwnRouteOnly):                 # its constructor asks for the model scenario
    def __init__(self):
        self.scenarios = ("gather", "model")

class BadRejections(OwnRouteOnly):
    rejection_types = (ValueError, 42)

INSTANCE = OwnRouteOnly()
'''


@pytest.fixture
def incomplete_module(tmp_path, monkeypatch):
    (tmp_path / "incomplete_adapters.py").write_text(INCOMPLETE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(impls, "_CACHE", {})
    yield "incomplete_adapters"
    sys.modules.pop("incomplete_adapters", None)


@pytest.mark.parametrize("obj, missing", [
    ("NoReader", "it does not implement read_buffers"),
    ("NoRoute", "it does not implement make_param or make_sharded_module"),
    ("OwnRouteWithHooks", "it does not implement make_param (for hooks)"),
    ("ModelLater", "it does not implement run_model (for model)"),
])
def test_an_incomplete_adapter_is_refused_at_load_in_one_line(incomplete_module, obj, missing):
    name = f"{incomplete_module}:{obj}"
    with pytest.raises(AdapterLoadError) as info:
        get_impl(name)
    message = str(info.value)
    assert missing in message and f"implementation {name!r} ({incomplete_module}.{obj})" in message
    assert "\n" not in message
    # what every caller of get_impl already reports as a usage error, and an AdapterError by kind
    assert isinstance(info.value, AdapterError) and isinstance(info.value, UnknownImplementationError)


def test_the_refusal_names_every_missing_method(incomplete_module):
    class Half(Implementation):
        def is_quantized(self, param):
            return True

    assert missing_methods(Half) == ["read_buffers", "make_param or make_sharded_module",
                                     "requantize_shard (for steps, reshard, layers, block)",
                                     "make_param (for hooks, virtual)"]


def test_an_adapter_on_its_own_route_needs_no_make_param(incomplete_module):
    assert get_impl(f"{incomplete_module}:OwnRouteOnly").scenarios == ("gather", "steps")
    assert isinstance(get_impl(f"{incomplete_module}:INSTANCE"), Implementation)


def test_rejection_types_that_are_neither_classes_nor_names_are_refused(incomplete_module):
    with pytest.raises(AdapterLoadError, match=r"rejection_types holds 42, neither an exception class nor a class"):
        get_impl(f"{incomplete_module}:BadRejections")


def test_an_incomplete_entry_point_is_refused(tmp_path, monkeypatch, incomplete_module):
    dist = tmp_path / "incomplete-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: incomplete\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[qgather.impls]\nhalfdone = incomplete_adapters:NoReader\n")
    with pytest.raises(AdapterLoadError, match=r"'halfdone' \(incomplete_adapters.NoReader\).*read_buffers"):
        get_impl("halfdone")


def test_every_builtin_and_test_adapter_loads(monkeypatch):
    monkeypatch.setattr(impls, "_CACHE", {})
    for name in impls.available():
        assert get_impl(name).name == name
    import tests._hang_adapters
    import tests._own_route_adapters
    import tests._why_adapters

    for module in (tests._why_adapters, tests._own_route_adapters, tests._hang_adapters):
        for attr, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, Implementation) and obj.__module__ == module.__name__:
                assert isinstance(get_impl(f"{module.__name__}:{attr}"), obj)


def test_readmes_adapter_example_names_every_method_an_adapter_needs():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("## Testing your own tensor subclass", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    methods = re.findall(r"^    def (\w+)\(", example, flags=re.M)
    scenarios = ast.literal_eval(re.search(r"^    scenarios = (.*?)\s*(#|$)", example, flags=re.M).group(1))
    body = {"scenarios": scenarios, **dict.fromkeys(methods, lambda *a: None)}
    adapter = type("ReadmeExample", (Implementation,), body)
    assert missing_methods(adapter) == [], methods


def test_the_default_scenarios_are_every_scenario_but_the_libraries_own_model():
    assert Implementation.scenarios == tuple(s for s in SCENARIOS if s != "model")


def test_unknown_implementation_is_a_usage_error_and_a_lookup_error():
    assert issubclass(UnknownImplementationError, UsageError) and issubclass(UnknownImplementationError, LookupError)


# ------------------------------------------------------------------ declared rejections, matched by class
class ShardAlignmentError(ValueError):
    """Named like the reference's refusal, from another module: never taken for it."""


@dataclass(frozen=True)
class _Record:
    """What a rank reports of an exception (qgather.runtime.outcome.RankError's fields)."""

    type_name: str
    message: str
    type_names: tuple[str, ...] = ()
    type_qualnames: tuple[str, ...] = ()

    @classmethod
    def of(cls, exc: BaseException) -> _Record:
        mro = type(exc).__mro__
        return cls(type(exc).__name__, str(exc), tuple(c.__name__ for c in mro),
                   tuple(f"{c.__module__}.{c.__qualname__}" for c in mro))


def test_a_declared_class_matches_itself_and_its_subclasses_by_qualified_name():
    reference = ReferenceImplementation()
    for error in (ReferenceShardAlignmentError("shard 1 starts at row 18"), FormatError("nvfp4 needs even rows")):
        assert reference.refusal_problem(error) == ""
        assert reference.refusal_problem(_Record.of(error)) == ""

    class Narrower(ReferenceShardAlignmentError):
        pass

    assert reference.refusal_problem(_Record.of(Narrower("x"))) == ""


def test_a_class_named_like_a_declared_one_from_another_module_does_not_match():
    reference = ReferenceImplementation()
    impostor = ShardAlignmentError("shard 1 starts at row 18")
    for error in (impostor, _Record.of(impostor)):
        problem = reference.refusal_problem(error)
        assert problem.startswith(f"{__name__}.ShardAlignmentError is not one of the implementation's declared "
                                  "rejection types (FormatError, qgather.impls.reference.param.ShardAlignmentError; ")
        assert "\n" not in problem
    # the bare-name record of before (no qualified names) never matches a class either
    assert reference.refusal_problem(_Record("ShardAlignmentError", "x", ("ShardAlignmentError",))) != ""


def test_names_match_by_bare_class_name_and_message_prefix():
    class Library(ReferenceImplementation):
        rejection_types = ("AssertionError: FSDP2 requires", "NotImplementedError")

    impl = Library()
    assert impl.refusal_problem(AssertionError("FSDP2 requires shard_M % 16 == 0")) == ""
    assert impl.refusal_problem(_Record.of(NotImplementedError("1-D block scaling"))) == ""
    assert impl.refusal_problem(AssertionError("some other assertion")) == (
        "AssertionError is not one of the implementation's declared rejection types (AssertionError: FSDP2 requires, "
        "NotImplementedError; Implementation.rejection_types)")


def test_an_adapter_that_declares_nothing_rejects_nothing():
    class Undeclared(ReferenceImplementation):
        rejection_types = ()

    problem = Undeclared().refusal_problem(ValueError("x"))
    assert problem.endswith("rejection types (none; Implementation.rejection_types)")


def test_the_adapters_errors_are_in_qgathers_hierarchy():
    assert base.HarnessFault is errors.HarnessFault
    assert issubclass(base.NoSingleDeviceTwin, errors.HarnessFault)
    assert issubclass(ReferenceShardAlignmentError, errors.Refusal)
    assert issubclass(ReferenceShardAlignmentError, ValueError)  # what it was before the hierarchy
    assert issubclass(TEUnavailable, errors.HarnessFault) and issubclass(TEUnavailable, RuntimeError)


TE_MODULES = Path(__file__).resolve().parents[1] / "harness" / "qgather" / "impls" / "te"


@pytest.mark.parametrize("path", sorted(TE_MODULES.glob("*.py")), ids=lambda p: p.name)
def test_te_modules_import_transformer_engine_only_inside_functions(path):
    """TE is installed only on GPU hosts: every te module but reference_bits (a subclass of a TE class,
    imported only by the function that installs it) must import without it."""
    top = [node for node in ast.parse(path.read_text()).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
    te_at_top = [n for n in names if n.startswith("transformer_engine")]
    assert (te_at_top != []) is (path.name == "reference_bits.py"), te_at_top


def test_only_a_package_module_object_name_names_a_user_adapter_module():
    from qgather.impls import adapter_module

    assert adapter_module("mypkg.adapters:MyImpl") == "mypkg.adapters"
    builtins = ("reference", "mutant:nibble_swap", "te:delayed", "torchao:precompute")
    assert [adapter_module(name) for name in builtins] == [None] * len(builtins)


def test_a_rank_records_and_a_rejection_matches_by_the_one_qualified_name():
    from qgather import errors
    from qgather.impls import rejections
    from qgather.runtime import outcome

    assert outcome.qualified_name is rejections.qualified_name is errors.qualified_name
    assert errors.first_line("  shard of 17 rows\n  in the hook") == "shard of 17 rows"
    assert errors.first_line("x" * 300, 200) == "x" * 197 + "..." and errors.first_line(None) == ""
