"""docs/ keeps up with the code: every bug class of the zoo and every reference format is documented.

A mutant added to the zoo's table (harness/qgather/impls/mutants/table.py), or a format added to
harness/qgather/formats, fails here until docs/bug-classes.md or docs/formats.md has its section."""

from __future__ import annotations

import os
import re

from qgather.formats import FORMATS
from qgather.impls.mutants import MUTANTS

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _sections(name: str, level: str = "## ") -> dict[str, str]:
    """Heading line -> the text up to the next heading of the same level."""
    with open(os.path.join(DOCS, name), encoding="utf-8") as fh:
        text = fh.read()
    parts = re.split(rf"^(?={re.escape(level)})", text, flags=re.M)
    return {p.splitlines()[0]: p for p in parts if p.startswith(level)}


def _class_sections() -> dict[int, tuple[str, str]]:
    """Bug class number -> (heading, body) of docs/bug-classes.md's numbered sections."""
    out: dict[int, tuple[str, str]] = {}
    for heading, body in _sections("bug-classes.md").items():
        match = re.match(r"## (\d+)\. ", heading)
        if match:
            assert int(match.group(1)) not in out, f"bug class {match.group(1)} has two sections"
            out[int(match.group(1))] = (heading, body)
    return out


def test_every_bug_class_of_the_zoo_has_a_section_naming_its_mutant():
    sections = _class_sections()
    assert sorted(sections) == sorted(m.bug_class for m in MUTANTS), "numbered sections != the zoo's bug classes"
    for mutant in MUTANTS:
        heading, _ = sections[mutant.bug_class]
        assert f"`{mutant.name}`" in heading, f"class {mutant.bug_class}'s heading does not name {mutant.name}"


def test_every_repro_in_bug_classes_is_a_catching_case_of_its_mutant():
    sections = _class_sections()
    for mutant in MUTANTS:
        _, body = sections[mutant.bug_class]
        repros = re.findall(r"python -m qgather case (\S+?)`", body)
        assert repros, f"class {mutant.bug_class} has no repro command"
        assert set(repros) <= set(mutant.catching_cases), f"class {mutant.bug_class}: {repros} not catching cases"


def test_every_reference_format_has_a_section_listing_its_buffers():
    sections = _sections("formats.md")
    builtin = {name: fmt for name, fmt in FORMATS.items() if type(fmt).__module__.startswith("qgather.formats")}
    assert builtin, "no reference format registered"

    def section(name: str) -> str:
        matching = [body for heading, body in sections.items() if f"`{name}`" in heading]
        assert len(matching) == 1, f"docs/formats.md: {len(matching)} sections for {name}"
        return matching[0]

    for name, fmt in builtin.items():
        body = section(name)
        # a section may point at a sibling's table ("those of `nvfp4_1d`") instead of repeating it
        texts = [body] + [section(other) for other in builtin if other != name and f"`{other}`" in body]
        shape = (4 * fmt.m_multiple * fmt.row_block, 4 * max(fmt.k_multiple, 32))
        missing = [b for b in fmt.buffer_specs(shape) if not any(f"`{b}`" in t for t in texts)]
        assert not missing, f"docs/formats.md's {name} section does not name its buffers {missing}"
