"""Standalone reproduction scripts: a case as one Python file that imports only torch, the library
under test and the standard library (`qgather repro ID --standalone [-o FILE]`), and the scripts
and upstream drafts of the findings in docs/ (`python -m qgather.tools.standalone [--check]`).

    from qgather.tools.standalone import render
    text = render("torchao:fp8_tensor:128x64:bf16:ws4:gather:s0:tp-2x2")
"""

from qgather.tools.standalone.generate import how_to_run, render
from qgather.tools.standalone.templates import UnsupportedCase

__all__ = ["UnsupportedCase", "how_to_run", "render"]
