"""Decides a case's verdict from what every rank returned or raised: `classify_outcome` for what a
pool brought back (every case on a pool, a checkpoint's save included), which hands every rank's
records to `classify_results` and errors to `classify_errors`, and turns a HANG or CRASH into its
verdict with every rank's notes and stacks. The verdict policy (which verdicts pass) is
qgather.model.policy's; this module only says what happened, with the evidence.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from qgather.engine.evidence import note_lines, stack_lines
from qgather.model.phases import BEFORE_DATA_MOVED
from qgather.model.records import Comparison, ModuleCheck, RankResult, Stage, WireSummary
from qgather.model.verdict import Verdict
from qgather.runtime.agreement import UnequalCollectiveSizes, UnjoinedCollective
from qgather.runtime.outcome import CaseOutcome, OutcomeStatus, RankError, same_error_on_every_rank


@dataclass(frozen=True)
class Classification:
    """What happened to a case, and the evidence: the engine turns it into the case's CaseReport."""

    verdict: Verdict
    reason: str
    details: tuple[str, ...] = ()
    #: the stage the verdict was found at, when it was one ("unshard 1"): the reason then reads
    #: "<stage>: <finding>" (CaseReport.finding)
    stage: str = ""


#: Whether an error is the implementation refusing a shape: "" when it is one of its declared
#: rejection types, else a one-line reason (Implementation.refusal_problem).
RefusalCheck = Callable[[RankError], str]


def no_declared_rejections(error: RankError) -> str:
    return f"{error.type_name} is not a declared rejection type (the implementation declares none)"


# Exception types that say the implementation's own code broke (a None where a tensor belongs, a
# missing attribute, a bad key or index; ranks handing one collective different sizes, or an amax
# reduction some of them would skip, which a held collective stops on every rank:
# qgather.runtime.agreement), not that it refused a shape: never a rejection, even when every rank
# raises the same one.
INTERNAL_ERRORS = frozenset({"AttributeError", "TypeError", "NameError", "UnboundLocalError", "KeyError",
                             "IndexError", "ZeroDivisionError", "RecursionError", "HarnessFault",
                             UnequalCollectiveSizes.__name__, UnjoinedCollective.__name__})

# Messages of Python's own faults that arrive as a ValueError (a hook unpacking fewer buffers than
# it expects): an internal fault, not a constraint being named.
INTERNAL_MESSAGES = re.compile(r"ValueError: (not enough|too many) values to unpack")
TRACEBACK_LINES = 6  # last lines of the first raising rank's traceback shown in an ERROR report


def classify_outcome(outcome: CaseOutcome, world_size: int,
                     refusal_problem: RefusalCheck = no_declared_rejections) -> Classification:
    """The one verdict of what a pool brought back: every rank's records (classify_results), some
    ranks' errors (classify_errors, with where the ranks that never answered were), or a HANG or
    CRASH (the outcome's headline, with every rank's notes and stacks)."""
    if outcome.status is OutcomeStatus.OK:
        return classify_results(outcome.results)
    if outcome.status is OutcomeStatus.ERROR:
        found = classify_errors(outcome.errors, world_size, refusal_problem, held=outcome.held_back)
        if not outcome.unfinished:
            return found
        # the ranks that never answered: where they were when the pool gave up on them
        left = {rank: facts for rank, facts in outcome.notes.items() if rank in outcome.unfinished}
        return replace(found, details=(*found.details, *note_lines(left)))
    verdict = Verdict.HANG if outcome.status is OutcomeStatus.HANG else Verdict.CRASH
    return Classification(verdict, outcome.headline(), tuple(note_lines(outcome.notes) + stack_lines(outcome.stacks)))


def classify_errors(errors: Mapping[int, RankError], world_size: int,
                    refusal_problem: RefusalCheck = no_declared_rejections,
                    held: Mapping[int, str] | None = None) -> Classification:
    """Some ranks raised. REJECTED only when every rank raised the same error (up to numbers: each
    rank may name its own shard size), before any data moved, of a type the implementation declares
    as its rejection (`refusal_problem` returns ""), and no internal fault (INTERNAL_ERRORS,
    INTERNAL_MESSAGES). Anything else is an ERROR with each rank's own message. `held`: the ranks that
    did not raise but left the case before a collective the failed rank would never join (rank -> that
    collective; qgather.runtime.agreement)."""
    lines = {rank: e.first_line(limit=None) for rank, e in errors.items()}
    internal = any(INTERNAL_ERRORS & set(e.type_names or (e.type_name,)) for e in errors.values()) \
        or any(INTERNAL_MESSAGES.match(m) for m in lines.values())
    same = same_error_on_every_rank(errors, world_size) is not None
    refusal = _refusal(errors, refusal_problem)
    if same and not internal and not refusal:
        details = [f"rank {r}: {m}" for r, m in sorted(lines.items())] if len(set(lines.values())) > 1 else []
        return Classification(Verdict.REJECTED, lines[min(errors)], tuple(details))
    rank = min(errors)
    waiting = sorted(set(range(world_size)) - set(errors))
    reason = f"rank {rank} raised {lines[rank]}"
    if errors[rank].phase:
        reason += f" (in the {errors[rank].phase})"
    details = [f"rank {r}: {m}" for r, m in sorted(lines.items())]
    if waiting:
        details.extend(_waiting_lines(waiting, held or {}))
    elif internal and same:
        details.append(f"every rank raised {errors[rank].type_name}: an internal fault of the "
                       "implementation, not a rejection naming a constraint")
    elif same and refusal:
        details.append(f"every rank raised the same error, but not a rejection: {refusal}")
    if errors[rank].traceback_text:
        details.append(f"rank {rank} traceback (last lines):")
        details.extend("  " + line for line in errors[rank].traceback_text.strip().splitlines()[-TRACEBACK_LINES:])
    return Classification(Verdict.ERROR, reason, tuple(details))


def _waiting_lines(waiting: list[int], held: Mapping[int, str]) -> list[str]:
    """What the ranks that did not raise did: left the case at a held collective, or would wait in one."""
    released = [r for r in waiting if r in held]
    left = [r for r in waiting if r not in held]
    lines = []
    if released:
        collectives = ", ".join(sorted({held[r] for r in released}))
        lines.append(f"ranks {_ranks(released)} did not raise: held before {collectives}, which the failed rank "
                     "would never join, they left the case")
    if left:
        lines.append(f"ranks {_ranks(left)} did not raise (they would wait in the collective)")
    return lines


def _refusal(errors: Mapping[int, RankError], refusal_problem: RefusalCheck) -> str:
    """Why these errors are not the implementation refusing a shape ("" when they are)."""
    for error in errors.values():
        problem = refusal_problem(error)
        if problem:
            return problem
        if error.phase not in BEFORE_DATA_MOVED:
            return f"raised in the {error.phase or 'unknown phase'}, not before any data moved"
    return ""


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)


def classify_results(results: Sequence[RankResult]) -> Classification:
    """Every rank returned: compare them with each other and with the golden. A weight the
    implementation refused (a layers case) makes the case REJECTED only when everything else it
    gathered is EXACT: a refusal never hides a wrong gather of the other weights."""
    details: list[str] = []
    refused: list[Stage] = []
    n_stages = max(len(r.stages) for r in results)
    for index in range(n_stages):
        stages = [r.stages[index] for r in results if index < len(r.stages)]
        if any(s.refused for s in stages):
            problem = _refusal_problem(stages, results)
            if problem:
                return Classification(Verdict.ERROR, f"{stages[0].label}: {problem}", tuple(details),
                                      stages[0].label)
            refused.append(stages[0])
            continue
        verdict, reason = _classify_stage(stages, results, details)
        if verdict is not Verdict.EXACT:
            return Classification(verdict, f"{stages[0].label}: {reason}", tuple(details), stages[0].label)
    for wire in (results[0].wire, *results[0].wires):
        degraded = _wire_verdict(wire)
        if degraded:
            where = f"{wire.label}: " if wire.label else ""
            return Classification(Verdict.DEGRADED, where + degraded, tuple(details), wire.label)
    if results[0].quantizer:
        return Classification(Verdict.QUANTIZER_MISMATCH, "its own quantizer disagrees with the reference",
                              tuple(d.line() for d in results[0].quantizer))
    details = [line for wire in (results[0].wire, *results[0].wires) for line in _wire_details(wire)]
    details += dict.fromkeys(s.note for s in results[0].stages if s.note)
    if refused:
        judged = sum(1 for s in results[0].stages if not s.refused)
        return Classification(Verdict.REJECTED, "; ".join(f"{s.label}: {s.refused}" for s in refused),
                              (f"the module was built without the refused weight; its other {judged} stages "
                               "(every gather of the other weights, the outputs) are EXACT", *details))
    output = results[0].stages[0].output
    if output is not None and output.tolerance:
        details.append(f"layer output compared within {output.tolerance} (not bitwise: another GEMM kernel)")
    details.extend(_module_lines(results[0].stages[0].module))
    return Classification(Verdict.EXACT, "", tuple(details))


def _refusal_problem(stages: list[Stage], results: Sequence[RankResult]) -> str:
    """Why a refused weight fails the case ("" when the refusal is one the policy accepts)."""
    ranks = [r.rank for r, s in zip(results, stages) if not s.refused]
    if ranks:
        return f"refused on some ranks only (not on ranks {_ranks(ranks)})"
    if not stages[0].refusal_accepted:
        return (f"refused ({stages[0].refused}) although every shard of it is aligned: the policy accepts "
                "only EXACT for it")
    return ""


def _module_lines(check: ModuleCheck | None) -> list[str]:
    if check is None:
        return []
    if check.note:
        return [f"library forward not compared: {check.note}"]
    return ["library forward with the gathered weight: bit-identical to the same module on one device"]


def _equal(comparison: Comparison | None) -> bool:
    return comparison is None or comparison.equal


def _classify_stage(stages: list[Stage], results: Sequence[RankResult], details: list[str]) -> tuple[Verdict, str]:
    if any(not s.quantized for s in stages):
        ranks = [r.rank for r, s in zip(results, stages) if not s.quantized]
        values = stages[0].values
        details.append(f"values vs golden dequantized: {'equal' if values and values.equal else 'differ'}")
        return Verdict.DEGRADED, f"the gathered weight is a plain high-precision tensor on ranks {_ranks(ranks)}"
    if stages[0].accepted_unholdable:
        what = "a tp piece of a weight" if stages[0].piece else "a shape"
        return Verdict.SILENT_MISMATCH, f"accepted {what} the format cannot hold ({stages[0].accepted_unholdable})"
    wrong_dtype = [r.rank for r, s in zip(results, stages) if s.dtype_problem]
    if wrong_dtype:
        return Verdict.SILENT_MISMATCH, f"{stages[0].dtype_problem or 'wrong dtype'} (ranks {_ranks(wrong_dtype)})"
    digests = _group_ranks(results, stages, lambda s: s.digest)
    if _diverge(digests):
        details.append(_grouping_line("gathered buffers", digests))
        details.extend(_stage_details(stages[0], results[0].rank))
        return Verdict.RANK_DIVERGENCE, f"ranks{_of_one_piece(digests)} hold {_most_results(digests)} different " \
                                        "gathered results"
    for stage in _one_per_piece(stages):  # ranks of one piece agree: each piece is judged once
        if stage.buffer_diffs or not _equal(stage.dequantized):
            details.extend(_piece_line(stage) + _stage_details(stage, None))
            details.extend(_forward_error_lines(stages, results))
            reason = "; ".join(d.line() for d in stage.buffer_diffs) or "dequantized values differ"
            return Verdict.SILENT_MISMATCH, f"{stage.piece}: {reason}" if stage.piece else reason
    own = [r.rank for r, s in zip(results, stages) if not _equal(s.own_dequantized)]
    if own:
        worst = next(s.own_dequantized for s in stages if not _equal(s.own_dequantized))
        details.append(f"its own dequantize(): {worst.n_diff} elements differ, max |diff| {worst.max_abs:.3g}")
        return Verdict.SILENT_MISMATCH, (f"the gathered buffers match, but its own dequantization of them "
                                         f"differs from the golden's on ranks {_ranks(own)}")
    return _classify_outputs(stages, results, details)


def _group_ranks(results: list[RankResult], stages: list[Stage], key) -> dict[tuple[str, str], list[int]]:
    """Ranks grouped by the piece of the weight they gathered (tensor parallelism: a TP piece; else
    the whole weight, "") and what `key` reads from their stage (a digest): ranks of one piece must
    agree, ranks of different TP pieces hold different pieces."""
    groups: dict[tuple[str, str], list[int]] = {}
    for result, stage in zip(results, stages):
        groups.setdefault((stage.piece, key(stage)), []).append(result.rank)
    return groups


def _diverge(groups: dict[tuple[str, str], list[int]]) -> bool:
    """Whether the ranks of some piece fall into more than one group."""
    pieces = [piece for piece, _ in groups]
    return len(pieces) != len(set(pieces))


def _most_results(groups: dict[tuple[str, str], list[int]]) -> int:
    pieces = [piece for piece, _ in groups]
    return max(pieces.count(p) for p in pieces)


def _of_one_piece(groups: dict[tuple[str, str], list[int]]) -> str:
    return " of one tp piece" if any(piece for piece, _ in groups) else ""


def _one_per_piece(stages: list[Stage]) -> list[Stage]:
    """The first rank's stage of every piece, in rank order (one stage without tensor parallelism)."""
    return list({stage.piece: stage for stage in reversed(stages)}.values())[::-1]


def _piece_line(stage: Stage) -> list[str]:
    return [f"the {stage.piece} differs from its slice of the one-device golden"] if stage.piece else []


def _grouping_line(what: str, groups: dict[tuple[str, str], list[int]]) -> str:
    by_piece = any(piece for piece, _ in groups)
    return f"ranks grouped by {'tp piece and ' if by_piece else ''}identical {what}: " + "; ".join(
        f"[{_ranks(r)}]" for r in groups.values())


def _forward_error_lines(stages: list[Stage], results: list[RankResult]) -> list[str]:
    return [f"rank {r.rank}: the forward then raised {s.forward_error}"
            for r, s in zip(results, stages) if s.forward_error]


def _classify_outputs(stages: list[Stage], results: Sequence[RankResult], details: list[str]) -> tuple[Verdict, str]:
    """The layer output of every rank: against the golden layer's and against each other."""
    raised = [r.rank for r, s in zip(results, stages) if s.forward_error]
    if raised:
        details.extend(_forward_error_lines(stages, results))
        first = next(s.forward_error for s in stages if s.forward_error)
        return Verdict.ERROR, f"the forward raised on ranks {_ranks(raised)} ({first}) with the right weight"
    outputs = _group_ranks(results, stages, lambda s: s.output_digest)
    if _diverge(outputs):
        details.append(_grouping_line("layer outputs", outputs))
        return Verdict.RANK_DIVERGENCE, "ranks compute different layer outputs from the same gathered weight"
    wrong = [s.output for s in stages if s.output is None or not s.output.equal]
    if wrong:
        out = wrong[0]
        if out is None:
            return Verdict.ERROR, "no layer output was computed"
        details.append(f"layer output: {out.n_diff} elements differ, max |diff| {out.max_abs:.3g}"
                       + (f" (allowed: {out.tolerance})" if out.tolerance else ""))
        return Verdict.SILENT_MISMATCH, "layer output differs from the golden layer's"
    return _classify_module(stages, results, details)


def _classify_module(stages: list[Stage], results: Sequence[RankResult], details: list[str]) -> tuple[Verdict, str]:
    """The library's own layer with the gathered weight against the same layer on one device."""
    checks = [(r.rank, s.module) for r, s in zip(results, stages) if s.module is not None]
    raised = [(rank, c.error) for rank, c in checks if c.error]
    if raised:
        details.extend(f"rank {rank}: its own forward raised {error}" for rank, error in raised)
        return Verdict.ERROR, (f"the library's own forward raised on ranks {_ranks([r for r, _ in raised])} with the "
                               "gathered weight, but not on one device with the full weight")
    wrong = [(rank, c.output) for rank, c in checks if c.output is not None and not c.output.equal]
    if wrong:
        rank, out = wrong[0]
        details.append(f"rank {rank}: {out.n_diff} output elements differ from the one-device module's, "
                       f"max |diff| {out.max_abs:.3g}")
        return Verdict.SILENT_MISMATCH, (f"the library's own forward with the gathered weight differs from the same "
                                         f"module on one device, on ranks {_ranks([r for r, _ in wrong])}")
    return Verdict.EXACT, ""


def _stage_details(stage: Stage, rank: int | None) -> list[str]:
    prefix = f"rank {rank}: " if rank is not None else ""
    lines = [prefix + d.line() for d in stage.buffer_diffs]
    deq = stage.dequantized
    if deq is not None and not deq.equal:
        lines.append(f"{prefix}dequantized weight: {deq.n_diff} elements differ, max |diff| {deq.max_abs:.3g}")
    lines.extend(stage.where)
    return lines


def _wire_verdict(wire: WireSummary | None) -> str:
    """DEGRADED when the gather moved more than the quantized shard: judged by the bytes measured at
    the collective against the implementation's allowance for its wire mode, whatever dtype labels
    the pre-hook put on them; a high-precision label is named beside it as evidence."""
    if wire is None:
        return ""
    numel, itemsize = wire.shard_numel, wire.param_itemsize
    if wire.hook_calls == 0 and wire.collective_bytes >= numel * min(itemsize, 2):
        return f"no pre-all-gather hook ran; {wire.collective_bytes} bytes moved per rank for {numel} elements"
    labels = (f"; the pre-hook handed {wire.high_precision_elements} high-precision elements to the gather"
              if wire.high_precision_elements else "")
    if wire.allowed_bytes and wire.collectives and wire.collective_bytes > wire.allowed_bytes:
        ratio = wire.collective_bytes / wire.packed_bytes
        return (f"{wire.collective_bytes} bytes moved per rank, {ratio:.2f}x the format's packed shard "
                f"({wire.packed_bytes} bytes), above the {wire.allowed_bytes} its {wire.wire_mode} wire may move"
                f"{labels}")
    if wire.high_precision_elements * 2 >= numel > 0:
        return (f"the pre-hook handed {wire.high_precision_elements} high-precision elements to the gather "
                f"(shard has {numel})")
    return ""


def _wire_details(wire: WireSummary | None) -> list[str]:
    if wire is None or not wire.packed_bytes:
        return []
    head = f"wire ({wire.label})" if wire.label else "wire"
    if wire.collectives == 0:
        return [f"{head}: no collective ran (world size 1)"]
    ratio = wire.collective_bytes / wire.packed_bytes
    return [f"{head}: {wire.collective_bytes} bytes per rank ({ratio:.2f}x the packed shard size)"]
