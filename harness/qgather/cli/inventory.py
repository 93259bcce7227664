"""What `qgather list` prints (qgather.cli.listing parses its arguments): the implementations and why one
cannot run here, the formats, scenarios and mutants, and the case ids of a selection."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from qgather.cli.common import selection_problem, usage
from qgather.formats import FORMATS, user_formats
from qgather.impls import UnknownImplementationError, available, get_impl
from qgather.impls.mutants import MUTANTS
from qgather.model.case import SCENARIOS, CaseSpec
from qgather.suite.options import joined_impls


def impl_status(name: str) -> str:
    """'available' or why the implementation cannot run here (probed on its first format)."""
    try:
        impl = get_impl(name)
    except UnknownImplementationError as exc:
        return f"unavailable: {exc}"
    if not impl.formats:
        return "no formats"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type not in impl.devices:
        return f"unavailable here: runs on {', '.join(impl.devices)} only, and this host has no GPU"
    probe = CaseSpec(name, impl.formats[0], (64, 64), "bf16", 2, impl.scenarios[0], 0)
    reason = impl.skip_reason(probe, device)
    return f"unavailable here: {reason}" if reason else "available"


def _list_impls() -> list[str]:
    return [f"{name:<32} {impl_status(name)}" for name in available() if not name.startswith("mutant:")]


def _list_formats() -> list[str]:
    """Each format and its row block; a format of the user's own (an adapter's, --formats', an entry
    point's) says where it comes from."""
    yours = set(user_formats())
    return [f"{name:<20} row block {fmt.row_block}"
            + (f"  (from {type(fmt).__module__}.{type(fmt).__qualname__})" if name in yours else "")
            for name, fmt in FORMATS.items()]


def _list_scenarios() -> list[str]:
    return list(SCENARIOS)


def _list_mutants() -> list[str]:
    return [f"{m.name:<36} bug class {m.bug_class}  expected {m.expected.value}" for m in MUTANTS]


LISTERS: dict[str, Callable[[], list[str]]] = {
    "impls": _list_impls, "formats": _list_formats, "scenarios": _list_scenarios, "mutants": _list_mutants,
}


def list_cases(args: argparse.Namespace) -> int:
    """The ids `qgather run` would run with this selection: without --exhaustive, no sweep marked slow."""
    from qgather.suite.coverage import suite_cases  # deferred: `qgather list` alone generates no case

    named = list(joined_impls(args.impl)) if args.impl else None
    cases, _ = suite_cases(list(joined_impls(args.impl)), args.formats, args.world_sizes, args.scenarios,
                           args.exhaustive, named=named, memo=True)
    problem = selection_problem(args, cases)
    if problem:
        return usage("list", problem)
    for case in cases:
        print(case.id)
    return 0
