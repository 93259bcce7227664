"""Checkpoint resharding (`dcp-wsA` in the id of a case of world size B): the FSDP2 module's state
dict (a DTensor of the quantized subclass) saved with torch.distributed.checkpoint at world size A,
loaded at world size B, then gathered and compared with the golden like any case.

The save is real: before the case, the runner runs `save_on_rank` on its warm pool of A ranks
(the same `fully_shard` module the case would build there, `dcp.save(module.state_dict())` over
that pool's process group) into a directory of its own, named like the pools' temp dirs
(`qgather-pool-<runner pid>-dcp-*`) so that a runner killed mid-case leaves nothing behind (see
qgather.runtime.lifeline); it is removed when the case ends. Then the case runs on the B pool,
whose module is built from ANOTHER weight (other values and another amax: `initial_master`), so
that a load that writes nothing, or that loses a per-tensor scale, cannot pass; `load` reads the
checkpoint into it (`dcp.load` in place, then `load_state_dict`, as training code does).

A save that fails is the case's verdict (its errors classified as at world size A, the reason
says so); a world size A the runtime cannot give (under torchrun/SLURM: any A but the launched
world) is SKIPPED with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace

import torch

from qgather.model.case import CaseSpec
from qgather.model.phases import Phase, PhaseTracker

#: seed offset of the weight a loading module starts from (never the checkpoint's)
DECOY_SEED = 7919
DECOY_SCALE = 4.0  # another amax too: a per-tensor scale the load fails to write stays visibly wrong


def saved_spec(spec: CaseSpec) -> CaseSpec:
    """The case as it runs at the checkpoint's world size A (where the save happens)."""
    config = replace(spec.config, saved_at_world_size=None, saved_after_forward=False, compile=False)
    return replace(spec, world_size=spec.config.saved_at_world_size, config=config)


def initial_master(spec: CaseSpec, master: torch.Tensor) -> torch.Tensor:
    """What the module is built from: the case's master, or for a loading case a decoy of the same
    shape (another seed, scaled), which the checkpoint must overwrite."""
    if spec.config.saved_at_world_size is None:
        return master
    from qgather.scenarios.core import make_weight

    return make_weight(replace(spec, seed=spec.seed + DECOY_SEED), master.device) * DECOY_SCALE


def load(ctx, spec: CaseSpec, module: torch.nn.Module, checkpoint: str | None, phases: PhaseTracker) -> str:
    """Read the checkpoint into the sharded module (nothing without one); returns a note for the report."""
    if checkpoint is None:
        return ""
    import torch.distributed.checkpoint as dcp

    with phases.at(Phase.LOAD):
        state = module.state_dict()
        dcp.load(state, checkpoint_id=checkpoint, process_group=ctx.group)
        module.load_state_dict(state)
    types = ", ".join(f"{name} {_type_name(t)}" for name, t in state.items())
    files = len([f for f in os.listdir(checkpoint) if f.endswith(".distcp")])
    trained = " after a training forward" if spec.config.saved_after_forward else ""
    return (f"loaded through torch.distributed.checkpoint, saved at world size {spec.config.saved_at_world_size}"
            f"{trained} "
            f"({files} .distcp files): {types}")


def save_on_rank(ctx, case_id: str, checkpoint: str) -> dict[str, str]:
    """On every rank of the A pool: build and shard the case's module at world size A (for
    `dcp-wsA-trained`: then run one training forward of it) and save its state dict. Returns what
    was saved (the state dict's types), as evidence."""
    from qgather.scenarios.core import build_sharded_module

    phases = PhaseTracker()
    with phases.tagging():
        case = CaseSpec.parse(case_id)
        spec = saved_spec(case)
        module = build_sharded_module(ctx, spec, phases)
        if case.config.saved_after_forward:
            with phases.at(Phase.FORWARD):
                _training_forward(ctx, spec, module)
        import torch.distributed.checkpoint as dcp

        with phases.at(Phase.SAVE):
            state = module.state_dict()
            dcp.save(state, checkpoint_id=checkpoint, process_group=ctx.group)
        return {name: _type_name(t) for name, t in state.items()}


def _training_forward(ctx, spec: CaseSpec, module: torch.nn.Module) -> None:
    """One forward of the sharded module as a training step runs it (FSDP2's unshard, the library's
    own forward under its context, e.g. te.autocast), then the reshard a root's forward skips."""
    from qgather.impls import get_impl
    from qgather.scenarios.core import make_input

    impl = get_impl(spec.impl)
    x = make_input(spec).to(device=ctx.device, dtype=spec.torch_dtype)
    with impl.gather_context(ctx.group), impl.forward_context(spec):
        module(x)
    module.reshard()


def _type_name(t: object) -> str:
    local = getattr(t, "_local_tensor", None)
    return f"{type(t).__name__}({type(local).__name__})" if local is not None else type(t).__name__


@contextlib.contextmanager
def saved_checkpoint(spec: CaseSpec, options) -> Iterator[tuple[str | None, object]]:
    """In the runner: (the checkpoint directory, None) once world size A saved it, or (None, the
    case's report) when the save could not run or failed. The directory is removed on exit."""
    path = tempfile.mkdtemp(prefix=f"{_pool_prefix()}{os.getpid()}-dcp-")
    try:
        yield _save(spec, options, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _pool_prefix() -> str:
    from qgather.runtime.lifeline import POOL_DIR_PREFIX

    return POOL_DIR_PREFIX


def _save(spec: CaseSpec, options, path: str) -> tuple[str | None, object]:
    from qgather.engine.classify import Classification, classify_errors
    from qgather.engine.run import refusal_check
    from qgather.model.verdict import Verdict
    from qgather.runtime import PoolSpec, PoolSpecError, get_pool

    size = spec.config.saved_at_world_size
    where = f"checkpoint save at world size {size}"
    pool_spec = PoolSpec(backend=options.backend_for(size), world_size=size, device=options.device_type())
    try:
        pool = get_pool(pool_spec.validate())
    except PoolSpecError as exc:
        return None, Classification(Verdict.SKIPPED, f"{where}: {exc}")
    kwargs = {"case_id": f"{saved_spec(spec).id} (DCP save for {spec.id})", "seed": spec.seed}
    if options.case_timeout is not None:
        kwargs["timeout"] = options.case_timeout
    outcome = pool.run(save_on_rank, spec.id, path, **kwargs)
    if outcome.status == "ok":
        return path, None
    if outcome.status == "error":
        found = classify_errors(outcome.errors, size, refusal_check(spec))
        return None, Classification(found.verdict, f"{where}: {found.reason}", found.details)
    verdict = Verdict.HANG if outcome.status == "hang" else Verdict.CRASH
    return None, Classification(verdict, f"{where}: {outcome.headline()}")
