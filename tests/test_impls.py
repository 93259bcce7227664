"""Loading implementations without editing qgather: package.module:object and entry points."""

import sys
import textwrap

import pytest

from qgather import impls
from qgather.impls import UnknownImplementationError, get_impl
from qgather.impls.reference import ReferenceImplementation


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
