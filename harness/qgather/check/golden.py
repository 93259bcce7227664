"""The golden: what a gathered weight must equal, quantized on one device from the full weight.

Under tensor parallelism a rank gathers only its TP piece: its golden is the full weight's golden
cut to that piece (`tensor_parallel_piece`), per-tensor values (the whole weight's amax) included.

For an implementation with its own quantizer the golden is its own single-device quantization of
the full weight (sharding invariance: gathering the shards gives q(W)); that quantization's
agreement with the reference formats is judged apart (`Golden.quantizer_diffs`, QUANTIZER_MISMATCH).

Past 400 lines on purpose: where a golden's buffers live (on its GPU, parked on the host, stepped aside
for the first unshard and on their way back) is one state of one class, whose views of each other must
change together with them; the copying itself is qgather.check.host's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from qgather.check import host
from qgather.errors import HarnessFault
from qgather.formats import Format, FormatError, QuantizedTensor
from qgather.formats.base import DequantizeParts, flat_dims
from qgather.impls.base import Implementation
from qgather.instruments import digest
from qgather.instruments.compare import Deferred, compare_buffers, differing_bits
from qgather.model.case import TensorParallelLayout
from qgather.model.layout import column_block
from qgather.model.records import BufferDiff, DiffProblem


@dataclass
class Golden:
    """What the gathered weight must equal (`q`), or why the format cannot hold it (`error`).
    Rank-local: it holds tensors and caches its dequantization; only its diffs travel."""

    q: QuantizedTensor | None
    error: str | None
    fmt: Format | None = None  # the format that dequantizes q
    source: str = "reference formats"
    quantizer_diffs: tuple[BufferDiff, ...] | None = None  # own quantizer vs reference; None: no own quantizer
    _whole: torch.Tensor | None = field(default=None, repr=False)
    _device: torch.device | None = field(default=None, repr=False)  # set while parked on the host
    _digest_parts: dict[str, bytes] = field(default_factory=dict, repr=False)
    _host: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # each buffer's host copy, once made
    _away: set[str] = field(default_factory=set, repr=False)  # the buffers waiting on the host now
    _output: tuple[torch.Tensor, bool, torch.Tensor] | None = field(default=None, repr=False)  # kept_output's
    _output_digest: str | None = field(default=None, repr=False)  # output_digest's, of _output's output
    _parts: dict[tuple[int, int], DequantizeParts | None] = field(default_factory=dict, repr=False)  # _deferred_parts'
    _pinned: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # step_aside's host copies, kept
    _aside: _Aside | None = field(default=None, repr=False)  # while stepped aside (step_aside .. arrived)
    _stream: torch.cuda.Stream | None = field(default=None, repr=False)  # come_back's copy stream, kept

    @property
    def nbytes(self) -> int:
        return 0 if self.q is None else sum(t.numel() * t.element_size() for t in self.q.buffers.values())

    def park(self, keep: Iterable[str] = ()) -> bool:
        """A large golden on a GPU waits in (pinned) host memory while the case shards and gathers, so
        that the device does not hold a second full quantization next to FSDP2's all-gather buffers;
        `unpark` brings back what a check reads. `keep`: buffers that stay on the device. A buffer's
        host copy is made once and kept: parking it again only lets its device copy go. Whether
        (some of) it is parked."""
        self.arrived()
        if self.q is None or not host.worth_parking(self.nbytes, self.device):
            return self.parked
        device, keep = self.device, set(keep)
        for name, tensor in self.q.buffers.items():
            if name in keep or name in self._away:
                continue
            if name not in self._host:
                self._host[name] = host.pinned_copy(tensor)
            self._hold(name, self._host[name])
            self._away.add(name)
        self._device = device if self._away else None
        return self.parked

    @property
    def parked(self) -> bool:
        return self._device is not None

    @property
    def device(self) -> torch.device:
        """Where the golden's values are computed and compared: its GPU, also while it is parked."""
        if self._device is not None:
            return self._device
        return self._aside.device if self._aside is not None else self.q.device

    def unpark(self, names: Iterable[str] | None = None) -> None:
        """Back onto the device: the buffers `names` (None: every buffer), copied without waiting
        (from pinned memory, ordered before the checks that read them); their host copies are kept
        for the next `park`. The golden stays parked until every buffer is back."""
        if self._device is None:
            return
        for name in sorted(self._away if names is None else set(names) & self._away):
            self._hold(name, self._host[name].to(self._device, non_blocking=True))
            self._away.discard(name)
        if not self._away:
            self._device = None

    def keep_on_device(self) -> None:
        """Back on the device for good, as one copy: parked (Golden.park) only while it was computed
        and cross-checked, a kept golden is read by every inspection where it is, with no copy from
        the host; each buffer the format derives from another is then held as a view of it where
        their bits agree (Format.derived_views)."""
        self.arrived()
        self.unpark()
        self._host.clear()
        if self.q is None:
            return
        for name, view in self.fmt.derived_views(self.q).items():
            held = self.q.buffers[name]
            if _same_view(held, view):  # kept so by an earlier case
                continue
            if held.shape == view.shape and held.dtype == view.dtype and not compare_buffers(
                    {name: held}, QuantizedTensor(self.q.format, self.q.shape, {name: view}, self.q.valid)):
                self._hold(name, view)

    def _hold(self, name: str, tensor: torch.Tensor) -> None:
        """Buffer `name` is `tensor` from now on; the deferred blocks made of the buffers let go (they are
        views of the one held before, which they would keep alive and read)."""
        self.q.buffers[name] = tensor
        self._parts.clear()

    def step_aside(self) -> bool:
        """A large golden kept on a GPU lets its device copy go while the library's first unshard runs
        (FSDP2's lazy initialization there may hold temporaries of several times the rank's shard:
        docs/findings.md, te-fp8-block-flat-view-copy): each of its large buffers is held by its host
        copy (pinned, made once and kept with the golden), a buffer held as a view of one of them
        (keep_on_device) by the same view of the copy. Only buffers that follow the rows step aside (the
        rowwise ones): the value checks read them check block by check block, so their way back runs
        beside the checks of the blocks before. Every check reads the same bits meanwhile (from the
        host, slowly); `come_back` starts their way back, `arrived` ends it. Whether it stepped aside."""
        self.arrived()
        if self.q is None or self.parked or not host.worth_parking(self.nbytes, self.device):
            return False
        views = self._held_views()
        names = [name for name, t in self.q.buffers.items() if name not in views and self._follows_rows(name)
                 and host.worth_parking(t.numel() * t.element_size(), t.device)]
        if not names:
            return False
        device = self.q.device
        for name in names:
            if name not in self._pinned:
                self._pinned[name] = host.pinned_copy(self.q.buffers[name])
            self._hold(name, self._pinned[name])
        self._derive(views)
        self._aside = _Aside(device, tuple(names))
        return True

    def come_back(self) -> None:
        """Start the way back of the buffers that stepped aside (host.WayBack, on a copy stream of the
        golden's own), check block by check block (Format.check_blocks), a mark after each block's rows.
        The golden holds the host copies until `arrived`; `dequantized_blocks(deferred=True)` reads each
        block from the device once its copies are done. Once per stepping aside."""
        aside = self._aside
        if aside is None or aside.way is not None:
            return
        if self._stream is None:
            self._stream = host.copy_stream(aside.device)
        way = host.WayBack(aside.device, self._stream)
        m, _ = flat_dims(self.q.shape)
        for start, stop in self.fmt.check_blocks(self.q.shape):
            for name in aside.names:
                per_entry = self.fmt.rowwise_rows[name][1]
                way.copy(name, self._pinned[name], start // per_entry, None if stop == m else -(-stop // per_entry))
            aside.marks.append(way.mark())
        aside.way = way

    def _follows_rows(self, name: str) -> bool:
        """Whether buffer `name`'s first dimension runs along the rows (Format.rowwise_rows)."""
        return self.fmt is not None and self.fmt.rowwise_rows.get(name, (None, 1))[0] == 0

    def arrived(self) -> None:
        """The end of the way back (started here if `come_back` was not called): the case's stream waits
        for every copy, and the golden holds the device tensors, and its views of them, from now on.
        Nothing while the golden has not stepped aside."""
        aside = self._aside
        if aside is None:
            return
        self.come_back()
        views = self._held_views()
        tensors = aside.way.arrived()
        self._aside = None
        for name, tensor in tensors.items():
            self._hold(name, tensor)
        self._derive(views)

    def _arriving_rows(self, index: int, start: int, stop: int) -> torch.Tensor | Deferred:
        """Rows [start, stop), check block `index`, of a golden on its way back, read from the device
        once the case's stream has waited for the block's copies."""
        self.come_back()
        aside = self._aside
        aside.way.wait_for(aside.marks[index])
        q = QuantizedTensor(self.q.format, self.q.shape, {**self.q.buffers, **aside.way.tensors}, self.q.valid)
        parts = self.fmt.dequantize_rows_parts(q, start, stop)
        if parts is None:
            return self.fmt.dequantize_rows(q, start, stop)
        return Deferred(*parts, torch.Size((stop - start, flat_dims(self.q.shape)[1])))

    def _held_views(self) -> list[str]:
        """The buffers the golden holds as views of another (Format.derived_views)."""
        if self.fmt is None:
            return []
        return [name for name, view in self.fmt.derived_views(self.q).items() if _same_view(self.q.buffers[name], view)]

    def _derive(self, names: Iterable[str]) -> None:
        """Buffers `names` held as views of the buffers they derive from, as those are now."""
        views = self.fmt.derived_views(self.q) if names else {}
        for name in names:
            self._hold(name, views[name])

    def kept_output(self, x: torch.Tensor, blocks: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The golden layer's output for input `x` (computed whole, or block of rows by block with
        `blocks`) as an earlier inspection kept it (keep_output), with the count of x's elements whose
        bits differ from the input it was computed for (on the device, not read: the caller reads it
        with its other counts and serves the output only where it is 0); None where the kept one is of
        another shape, dtype, device or blocking. The golden's values do not change, so a later case of a
        kept golden with the same input reads it instead of dequantizing and multiplying the whole
        golden again."""
        if self._output is None:
            return None
        kept_x, kept_blocks, output = self._output
        if kept_blocks != blocks or kept_x.dtype != x.dtype or kept_x.shape != x.shape or kept_x.device != x.device:
            return None
        return output, differing_bits(kept_x, x)

    def keep_output(self, x: torch.Tensor, blocks: bool, output: torch.Tensor) -> None:
        """Keep the golden layer's output for input `x` (the last one only: a few rows of output)."""
        self._output = (x.detach().clone(), blocks, output.detach())
        self._output_digest = None

    def output_digest(self) -> str:
        """digest.digest of the kept output (keep_output) as an inspection's output digest, computed once."""
        if self._output_digest is None:
            self._output_digest = digest.digest({"output": self._output[2]}, {})
        return self._output_digest

    def replace_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Let `buffers` (where the golden's buffers are now) stand for the golden's own."""
        for name, tensor in buffers.items():
            self._hold(name, tensor)
            self._host.pop(name, None)
            if name in self._away:
                self._host[name] = tensor
        self._digest_parts = {k: v for k, v in self._digest_parts.items() if k not in buffers}
        self._output = self._output_digest = None  # of other values

    def digest_parts(self, identical: dict[str, torch.Tensor]) -> dict[str, bytes]:
        """digest.digest_part of each of the `identical` buffers (gathered buffers whose valid regions
        equal the golden's bit for bit, in the same shape and dtype):
        what the golden's own buffer hashes to, computed from the first such buffer and kept with the
        golden, so that a kept golden serves it to every later case (also while it waits on the host)."""
        for name, tensor in identical.items():
            if name not in self._digest_parts:
                self._digest_parts[name] = digest.digest_part(name, tensor, self.q.valid)
        return {name: self._digest_parts[name] for name in identical}

    def value_buffers(self) -> list[str]:
        """The buffers its dequantization reads (the rowwise ones and the per-tensor values)."""
        if not self.fmt.rowwise_rows:
            return list(self.q.buffers)
        return [n for n in self.q.buffers if n in self.fmt.rowwise_rows or n in self.fmt.glob_keys]

    def dequantized_blocks(self, deferred: bool = False) -> Iterator[tuple[slice, torch.Tensor | Deferred]]:
        """The golden's float32 values as (rows, block) over the flattened (M, K) weight: one block
        (computed once, kept) while the format judges it whole, else its check blocks
        (Format.check_blocks) computed as they are asked for, so that a large golden is never kept
        dequantized.
        A parked golden stays on the host: each block's buffers come over as the block is asked for.
        deferred: row blocks of a golden on its device come as compare.Deferred where the format
        splits its dequantization so (a comparison may then never make the values).
        """
        m, _ = flat_dims(self.q.shape)
        whole = self.fmt.judged_whole(self.q.shape)
        if self._aside is not None and (whole or not deferred):
            self.arrived()  # only the deferred row blocks are read on the way back
        if whole:
            if self._whole is None:
                self.unpark(self.value_buffers())
                self._whole = self.fmt.dequantize(self.q).reshape(m, -1)
            yield slice(0, m), self._whole
            return
        for index, (start, stop) in enumerate(self.fmt.check_blocks(self.q.shape)):
            if self._aside is not None:  # deferred: each block read from the device once it is there
                yield slice(start, stop), self._arriving_rows(index, start, stop)
                continue
            parts = self._deferred_parts(start, stop) if deferred and not self.parked else None
            if parts is not None:
                yield slice(start, stop), Deferred(*parts, torch.Size((stop - start, flat_dims(self.q.shape)[1])))
            else:
                yield slice(start, stop), self.fmt.dequantize_rows(self.q, start, stop, device=self._device)

    def _deferred_parts(self, start: int, stop: int) -> DequantizeParts | None:
        """Format.dequantize_rows_parts of rows [start, stop), made once and kept while the golden holds
        the same buffers (`_hold` lets them go): every inspection of a kept golden reads the same blocks."""
        if (start, stop) not in self._parts:
            self._parts[(start, stop)] = self.fmt.dequantize_rows_parts(self.q, start, stop)
        return self._parts[(start, stop)]

    def dequantized_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The golden's values rounded to `dtype`, in the weight's shape."""
        m, k = flat_dims(self.q.shape)
        out = torch.empty((m, k), dtype=dtype, device=self.device)
        for rows, values in self.dequantized_blocks():
            out[rows] = values
            del values  # not held while the next block is made
        return out.reshape(self.q.shape)


@dataclass
class _Aside:
    """A golden stepped aside (Golden.step_aside): its device, the buffers held by their host copies, and
    once `come_back` started their way back, the copies and the mark after each check block's rows."""

    device: torch.device
    names: tuple[str, ...]
    way: host.WayBack | None = None
    marks: list[int] = field(default_factory=list)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def golden_for(fmt: Format, weight: torch.Tensor, impl: Implementation | None = None,
               parked: bool = False) -> Golden:
    """The golden of `weight` in `fmt`: the reference formats' quantization (the implementation's
    `reference_quantize`), or the implementation's own quantization where it has one in the
    format's layout. A shape the format cannot hold gives a golden with only its `error`.

    parked: a large golden is left waiting on the host (Golden.park), from before the
    implementation's own quantization is cross-checked against it, so that the device never holds
    the two quantizations (nor the reference's next to the weight and one of its own parts)."""
    try:
        ref = impl.reference_quantize(fmt, weight) if impl is not None else fmt.quantize(weight)
    except FormatError as exc:
        return Golden(None, str(exc))
    except NotImplementedError:
        ref = None  # a format registered with its layout only: no reference quantizer in qgather
    if ref is None:
        own = impl.own_quantization(fmt.name, weight) if impl is not None else None
        return _own_golden_only(fmt, weight, impl, own)
    golden = Golden(ref, None, fmt)
    if parked:
        golden.park()
    parts = impl.own_quantization_parts(fmt.name, weight) if impl is not None else None
    if parts is None:
        return golden
    diffs, replacements = _cross_check(golden.q, parts)
    golden.quantizer_diffs = diffs
    if not any(d.problem.breaks_layout for d in diffs):
        golden.replace_buffers(replacements)  # the golden is its own quantization (sharding invariance)
        golden.source = f"{impl.name}'s own quantizer"
    # else its own quantization does not even have the format's layout: judge against the reference
    return golden


def _cross_check(ref: QuantizedTensor, parts: Iterable[dict[str, torch.Tensor]]
                 ) -> tuple[tuple[BufferDiff, ...], dict[str, torch.Tensor]]:
    """The implementation's own quantization, part by part, against the reference's buffers: the
    differences, and its own buffers where their bits differ. Where they agree, the reference's
    buffer serves (the same bits), so that a large weight's golden never holds two full
    quantizations at once."""
    diffs: list[BufferDiff] = []
    differing: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for part in parts:
        seen |= set(part)
        unknown = sorted(set(part) - set(ref.buffers))
        if unknown:
            raise HarnessFault(f"own quantization returned buffers the format does not have: {', '.join(unknown)}")
        found = compare_buffers(part, QuantizedTensor(ref.format, ref.shape, {n: ref.buffers[n] for n in part},
                                                      ref.valid))
        diffs += found
        # kept where the reference's buffers are (on the host while a large golden is parked)
        differing.update({d.name: part[d.name].to(ref.device) for d in found if d.problem is DiffProblem.BITS})
    rest = QuantizedTensor(ref.format, ref.shape, {n: t for n, t in ref.buffers.items() if n not in seen}, ref.valid)
    return tuple(diffs + compare_buffers({}, rest)), differing


def _own_golden_only(fmt: Format, weight: torch.Tensor, impl: Implementation | None,
                     own: dict[str, torch.Tensor] | None) -> Golden:
    """A format without a reference quantizer is still testable: sharding invariance against the
    implementation's own q(W), in the format's layout (valid regions, dequantization)."""
    if own is None:
        name = impl.name if impl is not None else "the harness"
        raise HarnessFault(f"format {fmt.name} has no reference quantizer and {name} no own quantization: "
                           "there is nothing to judge the gather against")
    shape = tuple(weight.shape)
    q = QuantizedTensor(fmt.name, shape, dict(own), fmt.valid_regions(shape))
    return Golden(q, None, fmt, f"{impl.name}'s own quantizer (no reference quantizer)")


def tensor_parallel_piece(golden: Golden, tp: TensorParallelLayout, tp_rank: int) -> Golden:
    """The golden of TP rank `tp_rank`'s piece: the full weight's golden cut to the piece's rows
    (colwise) or columns (rowwise) in the format's row layout, its per-tensor values those of the
    whole weight. A piece that cuts a scale block has no such slice: a golden with only its `error`
    (gathering it anyway is accepting a weight the one-device quantization cannot give)."""
    if golden.q is None:
        return golden
    fmt, (start, end) = golden.fmt, tp.piece_range(tp_rank)
    block = fmt.row_block if tp.dim == 0 else column_block(fmt.name)
    what = "row" if tp.dim == 0 else "column"
    if start % block or (end - start) % block and end != tp.shape[tp.dim]:
        return Golden(None, f"{tp.label(tp_rank)} cuts {fmt.name}'s {block}-{what} scale blocks: no slice of the "
                            "one-device quantization holds it", fmt, golden.source, golden.quantizer_diffs)
    try:
        fmt.check(tp.piece_shape(tp_rank))
    except FormatError as exc:
        return Golden(None, f"{tp.label(tp_rank)} cannot be held: {exc}", fmt, golden.source, golden.quantizer_diffs)
    rows, glob = fmt.to_rows(golden.q)
    cut = {name: _cut(t, fmt.rows_per_entry[name], tp, start, end) for name, t in rows.items()}
    try:
        q = fmt.from_rows(cut, glob, tp.piece_shape(tp_rank))
    except FormatError as exc:
        raise HarnessFault(f"the golden of {tp.label(tp_rank)} could not be cut from the full golden: {exc}") from None
    return Golden(q, None, fmt, f"{golden.source}, cut to {tp.label(tp_rank)}", golden.quantizer_diffs)


def _cut(t: torch.Tensor, rows_per_entry: int, tp: TensorParallelLayout, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) (colwise) or columns [start, end) (rowwise) of one row-layout buffer."""
    if tp.dim == 0:
        return t[start // rows_per_entry: -(-end // rows_per_entry)].contiguous()
    width, k = t.shape[-1], tp.shape[1]
    return t[..., start * width // k: -(-end * width // k)].contiguous()
