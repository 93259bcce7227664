"""Preloaded by the forkserver of a run with torchao cases on a CPU build of torch (the adapter's
`rank_imports`): torchao's float8 API, which each rank forked from it would otherwise import on its
first torchao case (about 0.25 s of CPU per rank on the 2-core CI machine). A torchao that does not
import is left for the cases to report, as without the preload.
"""

from __future__ import annotations

import contextlib

from qgather.impls.torchao.adapter import _torchao

with contextlib.suppress(Exception):  # the cases report it, each in its own words
    _torchao()
