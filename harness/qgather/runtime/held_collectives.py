"""What the holds of runtime/agreement.py hold, by name: torch.distributed's collectives, torch's
functional ones, the library methods that all-reduce from native code; the code each has in the side
all-reduce, and the name of the frame that waits at its hold. Plain data (no torch), so that the
runner can read a rank's stack (runtime/outcome.py) without importing what the ranks hold."""

from __future__ import annotations

from collections.abc import Iterable

# torch.distributed's functions that are collectives over a group (the group argument's name).
# (all_gather_single and reduce_scatter_single: what FSDP2 calls on newer torch; absent names are skipped)
HELD = ("all_gather_into_tensor", "all_gather_single", "all_gather", "all_reduce", "reduce_scatter_tensor",
        "reduce_scatter_single", "reduce_scatter", "broadcast", "barrier", "all_to_all_single", "all_to_all",
        "reduce", "gather", "scatter", "all_gather_object", "broadcast_object_list", "gather_object",
        "scatter_object_list", "all_gather_coalesced", "all_reduce_coalesced", "_all_gather_base",
        "_reduce_scatter_base")

# Collectives whose input must have as many bytes on every rank: the input's (position, keyword).
SIZED = {"all_gather_into_tensor": (1, "input_tensor"), "_all_gather_base": (1, "input_tensor"),
         "all_gather_single": (1, "input_tensor"), "reduce_scatter_tensor": (1, "input"),
         "_reduce_scatter_base": (1, "input"), "reduce_scatter_single": (1, "input"),
         "all_reduce": (0, "tensor"), "broadcast": (0, "tensor")}
# torch's functional collectives (torch.ops._c10d_functional), held as ops: the group's name is their last
# argument, and the input (of SIZED ones) their first.
FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single",
              "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
FUNCTIONAL_SIZED = frozenset({"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"})
# Library methods that all-reduce an amax inside a native call (whereabouts.NATIVE_COLLECTIVES sees a
# rank waiting there): (module, class, methods). Held once the module is imported, never imported here.
NATIVE = (("transformer_engine.pytorch.tensor.float8_tensor", "Float8CurrentScalingQuantizer",
           ("quantize_impl", "update_quantized")),
          ("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Quantizer", ("quantize_impl", "update_quantized")))
# The NATIVE methods that return before their amax all-reduce when handed an empty input (TE 2.20's
# quantizer.cpp: Float8CurrentScalingQuantizer's and NVFP4Quantizer's quantize_impl, "Nothing to be done
# if input is empty", which update_quantized reaches too): a rank with a zero-row shard never joins the
# all-reduce that the ranks with rows enter and wait in.
EMPTY_INPUT_SKIPS = frozenset(f"{cls}.{method}" for _, cls, methods in NATIVE for method in methods)
# Each held collective's code in the side all-reduce: its place in one list that every rank builds alike.
CODES = (*HELD, *(f"{name} (functional)" for name in FUNCTIONAL),
         *(f"{cls}.{method}" for _, cls, methods in NATIVE for method in methods))
# The wrapper that holds a collective runs under a frame of this prefix and the collective's code
# (held_frame_name): a rank's stack or whereabouts then names the collective it waits to enter.
HELD_FRAME_PREFIX = "held_before__"
# The functions in which a rank waits at a hold: for every rank (the side all-reduce), or for the members
# of a smaller group (their keys in the store): Agreement._wait_for_every_rank, _wait_for_members.
HOLD_WAITS = ("_wait_for_every_rank", "_wait_for_members")


def held_frame_name(code: str) -> str:
    """The frame name of the wrapper that holds the collective `code` (e.g. held_before__barrier)."""
    return HELD_FRAME_PREFIX + "".join(c if c.isalnum() else "_" for c in code)


def held_collective(frame_name: str) -> str | None:
    """The collective a held wrapper's frame (held_frame_name) holds, in CODES' words; None for any other frame."""
    if not frame_name.startswith(HELD_FRAME_PREFIX):
        return None
    return next((code for code in CODES if held_frame_name(code) == frame_name), None)


def waits_at_hold(functions: Iterable[str]) -> str | None:
    """The collective a rank waits at the hold before, from its stack's function names (any order): a
    hold's wait (HOLD_WAITS) under the wrapper named after the collective. None where it waits at none."""
    names = list(functions)
    if not any(name in HOLD_WAITS for name in names):
        return None
    return next((code for name in names if (code := held_collective(name))), None)


def inside_held(functions: Iterable[str]) -> bool:
    """Inside a collective its hold let the rank into: the holding wrapper on the stack, no hold's wait."""
    names = list(functions)
    return not any(name in HOLD_WAITS for name in names) and any(name.startswith(HELD_FRAME_PREFIX) for name in names)
