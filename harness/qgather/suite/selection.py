"""What a selection runs: of the cases its sweeps generate, those of the implementations it names, in the
formats, scenarios and devices each implementation declares; and which of its listed values (a format,
a world size, a scenario) match none of them. The one place this is decided, for collection (the pytest
plugin), `qgather list --cases`, `qgather coverage` and `qgather run`'s check before pytest starts.

A case an implementation does not declare is not collected: a run of an adapter of one format is its
cases, not thousands of SKIPPED (Implementation.skip_reason still refuses one given by id).

    runnable(cases, named=("reference",), device_type="cpu")  -> no torchao companion rows
    unmatched(cases, world_sizes=(2, 5))  -> "--world-sizes 5: no case of the selection has world size 5"
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from qgather.impls import get_impl
from qgather.model.case import CaseSpec


def device_type(device: str) -> str:
    """The device a run's cases use: `cpu` / `cuda`, or for `auto` cuda where there is a GPU."""
    if device != "auto":
        return device
    import torch  # deferred: the command line validates its options before torch is imported

    return "cuda" if torch.cuda.is_available() else "cpu"


def declares(case: CaseSpec, device: str) -> bool:
    """Whether the case's implementation declares its format, its scenario and the device."""
    impl = get_impl(case.impl)
    return case.fmt in impl.formats and case.scenario in impl.scenarios and device in impl.devices


def runnable(cases: Iterable[CaseSpec], named: Sequence[str] | None, device: str) -> list[CaseSpec]:
    """The cases a run of the implementations `named` (None: the default run, with the sweeps'
    companions) runs on `device` (cpu or cuda): each implementation's declared ones."""
    chosen = None if named is None else set(named)
    return [c for c in cases if (chosen is None or c.impl in chosen) and declares(c, device)]


def unmatched(cases: Sequence[CaseSpec], formats: Sequence[str] | None = None,
              world_sizes: Sequence[int] | None = None, scenarios: Sequence[str] | None = None,
              impls: Sequence[str] | None = None, device: str = "cpu") -> str | None:
    """One line naming the listed values no case of the selection has (None: every value has cases);
    `impls`: the implementations --impl named (each must have cases on `device`)."""
    idle = [name for name in impls or () if name not in {c.impl for c in cases}]
    if idle:
        why = why_empty(idle, device)
        return f"--impl {','.join(idle)}: no case of the selection" + (f" ({why})" if why else "")
    for flag, values, field, what in (("--formats", formats, "fmt", "format"),
                                      ("--world-sizes", world_sizes, "world_size", "world size"),
                                      ("--scenarios", scenarios, "scenario", "scenario")):
        have = {getattr(c, field) for c in cases}
        missing = [v for v in values or () if v not in have]
        if missing:
            names = ",".join(map(str, missing))
            return f"{flag} {names}: no case of the selection has {what} {names}"
    return None


def why_empty(named: Sequence[str], device: str) -> str:
    """Why implementations have no case on `device` (they run on other devices), or ""."""
    devices = {n: get_impl(n).devices for n in named}
    elsewhere = [f"{n} runs on {', '.join(on)} only" for n, on in devices.items() if device not in on]
    return f"{'; '.join(elsewhere)}, and this run's device is {device}" if elsewhere else ""


def declared(named: Sequence[str]) -> str:
    """What the implementations declare, for a selection of them that matched no case, e.g.
    "mylib declares formats fp8_tensor and scenarios gather, steps, reshard"."""
    impls = {name: get_impl(name) for name in named}
    return "; ".join(f"{name} declares formats {', '.join(i.formats)} and scenarios {', '.join(i.scenarios)}"
                     for name, i in impls.items())
