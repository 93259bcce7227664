"""Inspection of one gathered weight on a rank: its buffers, dequantization, dtype and layer output
against the golden, and the library's own layer against its one-device twin, as a `Stage` record.

An error of the forward after the gather is recorded on the stage, not raised: the comparisons
already made stay part of the verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from qgather.check.golden import Golden
from qgather.errors import HarnessFault
from qgather.formats import Format, QuantizedTensor
from qgather.formats.base import flat_dims
from qgather.impls.base import Implementation, NoSingleDeviceTwin
from qgather.instruments.compare import (
    Deferred,
    compare_value_blocks,
    compare_values,
    launch_buffers,
    launch_value_blocks,
    launch_values,
    locate,
    read_together,
)
from qgather.instruments.digest import digest
from qgather.model.case import CaseSpec, ColumnShardLayout, ShardLayout
from qgather.model.records import Comparison, ModuleCheck, Stage

IDENTICAL_BUFFERS = "the same dequantization of bit-identical buffers"


@dataclass(frozen=True)
class TwinOutput:
    """What the library's module on one device, holding the full weight, computed (`output`), or
    why it computed nothing (`note`)."""

    output: torch.Tensor | None = None
    note: str = ""


@dataclass(frozen=True)
class Inspector:
    """What every inspection of one case compares with: the case, its implementation and format,
    the layer input `x` and how the weight is sharded (to say which rank sent a differing row)."""

    spec: CaseSpec
    impl: Implementation
    fmt: Format
    x: torch.Tensor
    shards: ShardLayout | ColumnShardLayout
    piece: str = ""  # tensor parallelism: the TP piece this rank gathers ("" without tp)

    def judge(self, param: torch.Tensor, golden: Golden, label: str, dtype: torch.dtype | None = None) -> Stage:
        """Compare one gathered (unsharded) weight with the golden, and its dtype with `dtype` (what
        the mixed-precision policy asks for) when given.

        Args:
            param: the unsharded weight as the gather left it (the implementation's subclass, or a
                plain tensor when it fell back to high precision); under tensor parallelism this
                rank's gathered TP piece.
            golden: what it must equal (under tensor parallelism: the full golden cut to the piece).
            label: the stage's name in the report (e.g. "unshard 1").
            dtype: the dtype the unsharded weight must have; None: not checked.

        Returns:
            The stage record: digests, buffer differences, value and output comparisons.
        """
        parked = golden.parked
        try:
            return replace(self._judge(param, golden, label, dtype), piece=self.piece)
        finally:
            if parked:  # the device copies the checks read are let go; the host copies stay
                golden.park()

    def _judge(self, param: torch.Tensor, golden: Golden, label: str, dtype: torch.dtype | None) -> Stage:
        impl, fmt = self.impl, self.fmt
        quantized = impl.is_quantized(param)
        dtype_problem = ""
        if dtype is not None and param.dtype != dtype:
            dtype_problem = f"the unsharded weight is {param.dtype}, the mixed-precision policy asks for {dtype}"
        if golden.q is None:
            return Stage(label, quantized, dtype_problem=dtype_problem,
                         accepted_unholdable=golden.error or "the format cannot hold this shape")
        m, k = flat_dims(golden.q.shape)
        if not quantized:
            values = param.detach().float().reshape(golden.q.shape)
            return Stage(label, quantized, digest({"values": values}, {}), dtype_problem=dtype_problem,
                         values=_against_golden(values.reshape(m, k), golden))
        # Every check is launched before any count is read: the host queues the next check while the
        # device runs the last, and waits once, at the end (read_together), not once per check.
        parked = golden.parked
        golden.unpark(golden.value_buffers())  # a parked golden: what the value checks read, where they run
        blocks = fmt.check_blocks(golden.q.shape)
        x = self.x.to(param.dtype)
        columns = OwnRowOutputs(impl, x, len(blocks)) if len(golden.q.shape) == 2 and len(blocks) > 1 else None
        try:
            own = _own_blocks_against_golden(impl, fmt, param, golden, blocks, columns)
            own_values = None if own is None else launch_value_blocks(own)
        except Exception as exc:  # the library cannot read its own gathered weight: say what it got
            _add_buffer_evidence(exc, impl.read_buffers(param), golden)
            raise
        output = self._launch_forward(param, golden, x, columns)
        # Last, so that what the library derives to show its buffers (e.g. TE's columnwise copy) never
        # lives beside the value checks' blocks; it is let go once digested: later checks read the
        # weight through the library, not these buffers.
        got = impl.read_buffers(param)
        golden.arrived()  # a golden on its way back (Golden.step_aside): every buffer, for the buffer checks
        golden.unpark()  # a parked golden comes over whole, once per inspection, after the gather's buffers exist
        buffers = launch_buffers(got, golden.q)
        diffs, own_dequantized, (output, output_digest, forward_error) = read_together(buffers, own_values, output)
        if parked:  # waits on the host again before the digest's temporaries (its host copy is kept)
            golden.park()
        buffers_digest, dequantized, where = self._evidence(got, golden, tuple(diffs))
        return Stage(label, quantized, buffers_digest, buffer_diffs=tuple(diffs), dequantized=dequantized,
                     own_dequantized=own_dequantized, output=output, output_digest=output_digest,
                     forward_error=forward_error, where=where, dtype_problem=dtype_problem)

    def _evidence(self, got: dict[str, torch.Tensor], golden: Golden, diffs: tuple
                  ) -> tuple[str, Comparison | None, tuple]:
        """(digest, dequantized values, where they differ) once the buffers are compared."""
        fmt = self.fmt
        buffers_digest = digest(got, golden.q.valid, golden.digest_parts(_identical(got, golden, diffs)))
        if not diffs:
            # The harness's own dequantization reads only the valid regions it just found bit-identical.
            return buffers_digest, Comparison(True, detail=IDENTICAL_BUFFERS), ()
        if any(d.problem.breaks_layout for d in diffs):
            return buffers_digest, None, ()
        golden.unpark()  # `locate` reads every buffer of both
        gathered = QuantizedTensor(fmt.name, golden.q.shape, got, golden.q.valid)
        dequantized = compare_value_blocks(lambda: ((fmt.dequantize_rows(gathered, rows.start, rows.stop), want)
                                                    for rows, want in golden.dequantized_blocks()))
        return buffers_digest, dequantized, tuple(locate(fmt, gathered, golden.q, self.shards))

    def _forward(self, param: torch.Tensor, golden: Golden, x: torch.Tensor | None = None,
                 columns: OwnRowOutputs | None = None) -> tuple[Comparison | None, str, str]:
        """(the layer output against the golden layer's, its digest, the forward's error) for the
        input `x` in the weight's dtype (default: the case's): `_launch_forward`, read."""
        return read_together(self._launch_forward(param, golden, x, columns))[0]

    def _launch_forward(self, param: torch.Tensor, golden: Golden, x: torch.Tensor | None = None,
                        columns: OwnRowOutputs | None = None) -> PendingOutput:
        """The layer output's comparison with the golden layer's, launched (PendingOutput); `columns`:
        the output as the value check computed it from the library's own row blocks, where it did."""
        x = self.x.to(param.dtype) if x is None else x
        try:
            y, blocks = self._output(param, x, golden, columns)
        except Exception as exc:  # noqa: BLE001 - the forward's error is evidence, next to the comparisons
            return PendingOutput(golden, x, param.dtype, None, False, self.impl.output_tolerance(self.fmt.name),
                                 _one_line(exc))
        return PendingOutput(golden, x, param.dtype, y, blocks, self.impl.output_tolerance(self.fmt.name))

    def _output(self, param: torch.Tensor, x: torch.Tensor, golden: Golden,
                columns: OwnRowOutputs | None) -> tuple[torch.Tensor, bool]:
        """The implementation's layer output, and whether it came block by block of the golden's rows
        (a large 2-D weight whose adapter can cut it by rows: `forward_own_rows` or `forward_rows`)."""
        tapped = None if columns is None else columns.output()
        if tapped is not None:
            return tapped, True
        blocks = golden.fmt.check_blocks(golden.q.shape) if len(golden.q.shape) == 2 else []
        if len(blocks) > 1:
            first = self.impl.forward_rows(param, x, *blocks[0])
            if first is not None:
                rest = (self.impl.forward_rows(param, x, start, stop) for start, stop in blocks[1:])
                return torch.cat([first, *rest], dim=-1), True
        return self.impl.forward(param, x), False

    @property
    def builds_twin(self) -> bool:
        """Whether `twin_output` builds the library's own module on one device (a full-size copy)."""
        return not self.piece and self._library_has_twin

    @property
    def _library_has_twin(self) -> bool:
        return type(self.impl).single_device_output is not Implementation.single_device_output

    def twin_output(self, weight: torch.Tensor, compute_dtype: torch.dtype) -> TwinOutput | None:
        """The one-device twin's forward of `x` (on the rank's device; `weight` there too, or a large
        one waiting in host memory: qgather.check.host) in the dtype the layer computes in (the mixed-precision
        policy's param_dtype: FSDP2 casts a root's inputs to it); None when the library has no module
        of its own. A shape the twin cannot run either is a note, not the gather's fault. Under tensor
        parallelism a TP rank's layer computes a part of the output (rowwise: a partial sum that the
        library all-reduces over "tp"), which no one-device module computes bit for bit: a note."""
        if self.piece:
            if not self._library_has_twin:
                return None
            return TwinOutput(note="under tensor parallelism each TP rank computes a part of the layer output; the "
                                   "gathered piece and x @ W_piece^T are compared, the library's forward is not")
        x = self.x.to(dtype=compute_dtype)  # on the rank's device, where a large weight may not be
        try:
            expected = self.impl.single_device_output(self.spec, weight, x)
        except NoSingleDeviceTwin as exc:
            return TwinOutput(note=str(exc))
        except Exception as exc:  # noqa: BLE001 - the library's own limit, recorded as a note
            return TwinOutput(note=f"the one-device module cannot run this case either: {_one_line(exc)}")
        return None if expected is None else TwinOutput(expected)

    def module_check(self, module: torch.nn.Module, twin: TwinOutput | None,
                     compute_dtype: torch.dtype) -> ModuleCheck | None:
        """The library's own forward with the gathered weight against its one-device twin's output."""
        if twin is None or twin.output is None:
            return None if twin is None else ModuleCheck(note=twin.note)
        try:
            got = self.impl.module_output(self.spec, module, self.x.to(device=twin.output.device, dtype=compute_dtype))
        except Exception as exc:  # noqa: BLE001 - evidence: the same forward ran on one device
            return ModuleCheck(error=_one_line(exc))
        return ModuleCheck(output=compare_values(got, twin.output))


def _identical(got: dict[str, torch.Tensor], golden: Golden, diffs: Iterable) -> dict[str, torch.Tensor]:
    """The gathered buffers whose valid regions equal the golden's bit for bit, in the same shape and
    dtype: their digest parts are the golden's (a large one's fingerprint, a small one's bytes, which a
    buffer on a device would otherwise copy to the host for every case)."""
    differing = {d.name for d in diffs}
    return {name: t for name, t in got.items() if name in golden.q.buffers and name not in differing
            and t.dtype == golden.q.buffers[name].dtype}


def _golden_output(x: torch.Tensor, golden: Golden, dtype: torch.dtype, blocks: bool) -> torch.Tensor:
    """The golden layer's output: x @ W^T with the golden's values rounded to `dtype`, block of rows by
    block when the implementation's output came so (the same GEMM shapes on both sides: bit for bit)."""
    if not blocks:
        return torch.matmul(x, golden.dequantized_as(dtype).transpose(-1, -2))
    columns = []
    for _, values in golden.dequantized_blocks():
        columns.append(torch.matmul(x, values.to(dtype).transpose(-1, -2)))
        del values  # not held while the next block is made
    return torch.cat(columns, dim=-1)


class PendingOutput:
    """The layer output `y` for input `x` against the golden layer's (its values rounded to the weight's
    `dtype`), launched (compare.Pending): against the output the golden keeps for this input where it
    keeps one, with the count that says whether `x` is that input (read with the rest: no wait of its
    own), else against one computed now and kept. `error`: the forward's, which is the result then."""

    def __init__(self, golden: Golden, x: torch.Tensor, dtype: torch.dtype, y: torch.Tensor | None, blocks: bool,
                 rel_tol: float | None, error: str = "") -> None:
        self.golden, self.x, self.dtype, self.y, self.blocks = golden, x, dtype, y, blocks
        self.rel_tol, self.error = rel_tol, error
        self.kept = None if error else golden.kept_output(x, blocks)
        self.counts: list[torch.Tensor] = []
        if error:
            return
        self.y_ref = self._computed() if self.kept is None else self.kept[0]
        self.compared = launch_values(y, self.y_ref, rel_tol)
        if self.kept is not None:
            self.counts.append(self.kept[1])
        self.counts.extend(self.compared.counts)

    def _computed(self) -> torch.Tensor:
        """The golden layer's output for this input, computed and kept with the golden."""
        y_ref = _golden_output(self.x, self.golden, self.dtype, self.blocks)
        self.golden.keep_output(self.x, self.blocks, y_ref)
        return y_ref

    def resolve(self, values: list[int]) -> tuple[Comparison | None, str, str]:
        """(the comparison, the output's digest, the forward's error)."""
        if self.error:
            return None, "", self.error
        if self.kept is not None and values[0]:  # another input than the kept output's
            self.y_ref = self._computed()
            compared = compare_values(self.y, self.y_ref, self.rel_tol)
        else:
            compared = self.compared.resolve(values[1:] if self.kept is not None else values)
        y, y_ref = self.y, self.y_ref
        identical = compared.n_diff == 0 and y.dtype == y_ref.dtype and y.shape == y_ref.shape
        # bit for bit the golden's output: its digest, kept with it (no copy of the output to the host)
        return compared, self.golden.output_digest() if identical else digest({"output": y}, {}), ""


class OwnRowOutputs:
    """The layer output's columns, computed from each of the library's own row blocks while the value
    check holds it (Implementation.forward_own_rows), so that a large weight is dequantized once for
    both checks. `output` is None where the adapter declined or a block never came."""

    def __init__(self, impl: Implementation, x: torch.Tensor, n_blocks: int) -> None:
        self.impl, self.x, self.n_blocks = impl, x, n_blocks
        self.columns: list[torch.Tensor] = []
        self.declined = False
        self.error: Exception | None = None

    def tapped(self, own_blocks: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """`own_blocks`, each block's output columns computed as it passes."""
        for rows in own_blocks:
            self._take(rows)
            yield rows
            del rows  # not held while the next block is made

    def _take(self, rows: torch.Tensor) -> None:
        if self.declined or self.error is not None:
            return
        try:
            y = self.impl.forward_own_rows(self.x, rows)
        except Exception as exc:  # noqa: BLE001 - the forward's error, raised where the output is asked for
            self.error = exc
            return
        if y is None:
            self.declined = True
        else:
            self.columns.append(y)

    def output(self) -> torch.Tensor | None:
        """The whole output (its columns in order), None without one; the forward's error, raised."""
        if self.error is not None:
            raise self.error
        if self.declined or len(self.columns) != self.n_blocks:
            return None
        return torch.cat(self.columns, dim=-1)


def _own_blocks_against_golden(impl: Implementation, fmt: Format, param: torch.Tensor, golden: Golden,
                               blocks: list[tuple[int, int]], columns: OwnRowOutputs | None = None
                               ) -> Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor | Deferred]]] | None:
    """What compare_value_blocks reads for the implementation's own dequantization: a maker of
    (own block, golden block) pairs, the golden blocks deferred (compare.Deferred) where they can
    be; None when the implementation has no dequantization of its own. `columns` takes the layer
    output's columns from the first pass's blocks."""
    first = impl.own_dequantize_blocks(param, fmt, blocks)
    if first is None:
        return None
    made: list[bool] = []

    def pairs() -> Iterator[tuple[torch.Tensor, torch.Tensor | Deferred]]:
        if made:
            own = impl.own_dequantize_blocks(param, fmt, blocks)  # again: to size a difference
        else:
            own = first if columns is None else columns.tapped(first)
        made.append(True)
        return _paired_with_golden(impl, own, golden, len(blocks))

    return pairs


def _paired_with_golden(impl: Implementation, own: Iterable[torch.Tensor], golden: Golden, n_blocks: int
                        ) -> Iterator[tuple[torch.Tensor, torch.Tensor | Deferred]]:
    """(own block, golden block) pairs; an implementation that yields another number of blocks
    than it was asked for would have some rows compared twice or not at all: said, with the counts."""
    own = iter(own)
    for count, (_, want) in enumerate(golden.dequantized_blocks(deferred=True)):
        got = next(own, None)
        if got is None:
            raise HarnessFault(f"{impl.name}: own_dequantize_blocks yielded {count} blocks for the {n_blocks} "
                               "row blocks it was asked for")
        yield got, want
        del got, want  # not held while the next block is made: one block of the library's values at a time
    if next(own, None) is not None:
        raise HarnessFault(f"{impl.name}: own_dequantize_blocks yielded more than the {n_blocks} row blocks "
                           "it was asked for")


def _against_golden(values: torch.Tensor, golden: Golden) -> Comparison:
    """`values` (the flattened (M, K) weight) against the golden's, block of rows by block."""
    return compare_value_blocks(lambda: ((values[rows], want) for rows, want in golden.dequantized_blocks()))


def _add_buffer_evidence(exc: Exception, got: dict[str, torch.Tensor], golden: Golden) -> None:
    """What the gathered buffers hold against the golden, as a note on the library's own error (the
    last lines of an ERROR's traceback in the report): a raise does not hide wrong bytes."""
    golden.arrived()
    golden.unpark()
    try:
        diffs = read_together(launch_buffers(got, golden.q))[0]
    except Exception as inner:  # noqa: BLE001 - the library's error stays the one raised
        note = f"qgather: the gathered buffers could not be compared with the golden ({_one_line(inner)})"
    else:
        note = ("qgather: the gathered buffers against the golden: "
                + ("; ".join(d.line() for d in diffs) if diffs else "every buffer bit-identical"))
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(note)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
