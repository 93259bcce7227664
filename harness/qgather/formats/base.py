"""The Format interface, the QuantizedTensor container and input validation shared by all formats."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qgather.errors import Refusal

from . import numerics as nx

#: (f, tensors): a dequantization as a module-level function of tensors alone and its arguments
DequantizeParts = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]

#: Input dtypes every format accepts (TE's high-precision dtypes).
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Tensors with more elements than this are quantized and dequantized in blocks of whole rows, so
#: that the float32 temporaries stay bounded (a GPU rank holds the golden of an 8192x28672 weight
#: next to the gathered one); the bits are the same as from one pass (tests/test_row_blocks.py).
ROW_BLOCK_ELEMENTS = 1 << 24
#: Such a tensor is judged (dequantized and compared: qgather.check) in row blocks of about this
#: many elements: each block costs the host a fixed time (the library's dequantize, a comparison
#: kernel's launch, the output's GEMM) that small blocks multiply, while a block's temporaries are a
#: few float32 copies of it (TE's blockwise dequantization: two, 8 bytes per element), which `qgather
#: bench gpu`'s memory goal bounds: 48 Mi elements, a fifth of its 8192x28672 weight, make 0.8 bf16
#: weights of them.
CHECK_BLOCK_ELEMENTS = 3 << 24
#: rows TE pads the per-row scale buffers of MXFP8 and NVFP4 to (their GEMM's swizzle unit)
SCALE_ROW_PADDING = 128


class FormatError(Refusal):
    """A tensor (or a rebuilt buffer set) that a format cannot hold; the message is one line that
    names the format and the constraint."""


@dataclass(eq=False)
class QuantizedTensor:
    """TE-layout buffers of one quantized tensor.

    format: the format name; shape: the original (unflattened) shape; buffers: name -> tensor
    (names, dtypes, 2-D shapes and padding as TE 2.20.2, padding zero); valid: name -> the
    region (tuple of slices) of each buffer that carries information.
    """

    format: str
    shape: tuple[int, ...]
    buffers: dict[str, torch.Tensor]
    valid: dict[str, tuple[slice, ...]]

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers.values())).device

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(self.format, self.shape,
                               {k: v.to(device) for k, v in self.buffers.items()}, dict(self.valid))

    def mismatches(self, other: QuantizedTensor, *, valid_only: bool = False) -> list[str]:
        """One line per difference from `other` (format, shape, buffer set, dtype, shape, bits);
        empty when both are bit-identical (in the valid regions only, if valid_only)."""
        out: list[str] = []
        if self.format != other.format:
            out.append(f"format {self.format} != {other.format}")
        if tuple(self.shape) != tuple(other.shape):
            out.append(f"shape {tuple(self.shape)} != {tuple(other.shape)}")
        if set(self.buffers) != set(other.buffers):
            out.append(f"buffers {sorted(self.buffers)} != {sorted(other.buffers)}")
            return out
        for name, a in self.buffers.items():
            b = other.buffers[name]
            if a.dtype != b.dtype or a.shape != b.shape:
                out.append(f"{name}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
                continue
            if valid_only:
                a, b = a[self.valid[name]], b[self.valid[name]]
            n = int((_bits(a) != _bits(b.to(a.device))).sum())
            if n:
                out.append(f"{name}: {n} elements differ")
        return out

    def bitwise_equal(self, other: QuantizedTensor, *, valid_only: bool = False) -> bool:
        return not self.mismatches(other, valid_only=valid_only)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of t's bits (so that -0.0 != 0.0 and NaN == NaN compare as bits)."""
    if t.dtype.is_floating_point and t.element_size() == 4:
        return t.view(torch.int32)
    if t.dtype.is_floating_point and t.element_size() == 2:
        return t.view(torch.int16)
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def flat_dims(shape: tuple[int, ...]) -> tuple[int, int]:
    """(M, K) = (prod(shape[:-1]), shape[-1])."""
    return math.prod(shape[:-1]), shape[-1]


def full(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


class Format:
    """One quantized weight format: the Format protocol, which the built-in formats and a format of
    your own (qgather.formats.registry.register_format checks it) keep alike.

    A format defines:
      - `name`: what case ids carry (no colon);
      - its buffers: `buffer_specs(shape)` -> name -> ((dims), dtype) of each buffer of a weight of
        `shape` (flattened to (M, K): M = prod(shape[:-1])), and `valid_regions(shape)` -> name -> the
        slices that carry information (padding outside them is never compared);
      - `_quantize(x2, amax, shape)` (x2: the (M, K) weight; amax: the global max|x|, for per-tensor
        scaling) -> a QuantizedTensor (`self._make(shape, buffers)`); `_dequantize(q)` -> float32 (M, K);
        `_dequantize_columnwise` too where `has_columnwise`;
      - its row layout, how FSDP2's dim-0 shards cut it: `_to_rows(q)` -> (rows, glob): each row buffer
        with dim 0 along the weight's rows, `rows_per_entry[name]` rows per entry, padding removed, and
        the per-tensor buffers (`glob_keys`, float32 (1,) each); `row_specs(shape)`; `_from_rows`, its
        inverse; `rowwise_rows`: the buffers dequantize reads by rows (axis, rows per entry);
      - its alignment rule: `row_block` (a shard that starts on a multiple of it gathers exactly; one
        that does not may be REJECTED) and which shapes it holds: `k_multiple`, `m_multiple`,
        `allow_empty_k`, `per_tensor` (quantize accepts amax=).
    From these alone qgather derives a format's shapes and regimes (qgather.suite.shape_space), its
    golden (qgather.check.golden), the wire allowance's packed size (qgather.check.wire) and its
    coverage cells. examples/rowwise/rowpkg/format.py is a complete one."""

    name: str = ""
    #: rows a shard must be a multiple of for exact gathers
    row_block: int = 1
    #: rows_per_entry of each key of to_rows()'s first dict
    rows_per_entry: dict[str, int] = {}
    #: keys of to_rows()'s second dict (per-tensor values)
    glob_keys: tuple[str, ...] = ()
    #: whether quantize() accepts amax= (per-tensor-scaled formats)
    per_tensor: bool = False
    #: whether there are columnwise buffers (dequantize_columnwise works)
    has_columnwise: bool = True
    #: K must be a multiple of this; M too if m_multiple is set
    k_multiple: int = 1
    m_multiple: int = 1
    #: whether K == 0 is allowed (M == 0 always is: FSDP2 ranks may hold zero rows)
    allow_empty_k: bool = False
    #: the buffers dequantize() reads that follow the rows: name -> (axis, rows per entry); the
    #: others it reads are per tensor (glob_keys). Empty: no row blocks (one pass, any size).
    rowwise_rows: dict[str, tuple[int, int]] = {}

    # ---------------------------------------------------------------- validation

    def check(self, shape, dtype: torch.dtype = torch.float32) -> None:
        """Raise FormatError (one line: format + constraint) if this format cannot hold a tensor of
        this shape and dtype."""
        shape = tuple(int(s) for s in shape)
        if dtype not in INPUT_DTYPES:
            raise FormatError(f"{self.name}: dtype {dtype} is not supported "
                              "(float32, bfloat16 or float16 required)")
        if len(shape) < 2:
            raise FormatError(f"{self.name}: a tensor of at least 2 dims is required, got shape {shape}")
        m, k = flat_dims(shape)
        if k == 0 and not self.allow_empty_k:
            raise FormatError(f"{self.name}: K=0 (empty last dim) cannot be quantized, shape {shape}")
        if k % self.k_multiple:
            raise FormatError(f"{self.name}: K={k} must be a multiple of {self.k_multiple}")
        if m % self.m_multiple:
            raise FormatError(f"{self.name}: M={m} (rows = prod(shape[:-1])) must be a multiple "
                              f"of {self.m_multiple}")

    def _check_q(self, q: QuantizedTensor) -> tuple[int, int]:
        if not isinstance(q, QuantizedTensor):
            raise FormatError(f"{self.name}: expected a QuantizedTensor, got {type(q).__name__}")
        if q.format != self.name:
            raise FormatError(f"{self.name}: got a QuantizedTensor of format {q.format}")
        return flat_dims(tuple(q.shape))

    # ---------------------------------------------------------------- public API

    def quantize(self, x: torch.Tensor, amax: torch.Tensor | float | None = None) -> QuantizedTensor:
        """Quantize x ((..., K), float32/bfloat16/float16, any device) into TE's buffers.

        amax (per-tensor-scaled formats only): the global max|x| to scale with instead of this
        tensor's own (a shard re-quantized with the all-reduced amax then equals the slice of the
        full quantization). Other formats raise FormatError (a ValueError) if it is given.
        """
        if not isinstance(x, torch.Tensor):
            raise FormatError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        shape = tuple(x.shape)
        self.check(shape, x.dtype)
        if amax is not None and not self.per_tensor:
            raise FormatError(f"{self.name}: amax= is only accepted by per-tensor-scaled formats "
                              "(fp8_tensor*, nvfp4_*)")
        m, k = flat_dims(shape)
        with torch.no_grad():  # parameters (requires_grad) are quantized as plain data
            x2 = x.detach().reshape(m, k).contiguous()
            local = nx.global_abs_amax(x2)
            if not bool(torch.isfinite(local).all()):
                raise FormatError(f"{self.name}: input contains NaN or inf")
            if amax is not None:
                amax = self._check_amax(amax, x.device)
            else:
                amax = local
            if m * k > ROW_BLOCK_ELEMENTS and self.rows_per_entry and self.rowwise_rows:
                return self._quantize_in_row_blocks(x2, amax, shape)
            return self._quantize(x2, amax, shape)

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        """float32 tensor of q.shape from the rowwise buffers."""
        self._check_q(q)
        return self._dequantize(q).reshape(q.shape)

    def row_blocks(self, shape, block_elements: int | None = None) -> list[tuple[int, int]]:
        """(start, stop) of the row blocks a tensor of `shape` is quantized in: one block while it is
        `judged_whole`, else blocks of whole scale blocks of about `block_elements` (default
        ROW_BLOCK_ELEMENTS; every block starts at a multiple of `row_block_multiple`)."""
        m, k = flat_dims(tuple(shape))
        if self.judged_whole(shape):
            return [(0, m)]
        unit = self.row_block_multiple
        step = max(unit, (block_elements or ROW_BLOCK_ELEMENTS) // max(1, k) // unit * unit)
        return [(start, min(m, start + step)) for start in range(0, m, step)]

    def check_blocks(self, shape) -> list[tuple[int, int]]:
        """The row blocks a tensor of `shape` is dequantized and compared in (qgather.check):
        `row_blocks` of CHECK_BLOCK_ELEMENTS. Both sides of a comparison (the golden, the library's
        own dequantization and layer output) are cut alike."""
        return self.row_blocks(shape, CHECK_BLOCK_ELEMENTS)

    def judged_whole(self, shape) -> bool:
        """Whether a tensor of `shape` is quantized and dequantized in one pass (up to
        ROW_BLOCK_ELEMENTS elements, or a format without rowwise_rows): its golden's values are
        then made once and kept."""
        m, k = flat_dims(tuple(shape))
        return m * k <= ROW_BLOCK_ELEMENTS or not self.rowwise_rows

    @property
    def row_block_multiple(self) -> int:
        """Rows every block but the last holds a multiple of: no scale block or row-layout entry
        straddles two blocks, and every block is a tensor TE accepts (TE pads per-row scale
        buffers to SCALE_ROW_PADDING rows and checks that shape)."""
        per_entry = [*self.rows_per_entry.values(), *(r for _, r in self.rowwise_rows.values())]
        return math.lcm(SCALE_ROW_PADDING, self.row_block, self.m_multiple, *per_entry)

    def dequantize_rows(self, q: QuantizedTensor, start: int, stop: int,
                        device: torch.device | None = None) -> torch.Tensor:
        """float32 rows [start, stop) of the flattened (M, K) dequantized tensor, reading only those
        rows' buffers (start: a multiple of row_block_multiple). `device`: where to dequantize, the
        rows' buffers copied there first (a golden waiting in host memory); None: q's device."""
        m, k = self._check_q(q)
        if (start, stop) == (0, m) or not self.rowwise_rows:
            return self._dequantize(q if device is None else q.to(device)).reshape(m, k)[start:stop]
        return self._dequantize(self._row_block(q, start, stop, device)).reshape(stop - start, k)

    def dequantize_rows_parts(self, q: QuantizedTensor, start: int, stop: int) -> DequantizeParts | None:
        """(f, tensors) such that f(*tensors) is dequantize_rows(q, start, stop) bit for bit, f a
        module-level function of tensors alone (what a compiled comparison takes in place of the
        values, so that they never exist in memory); None where the format is not split so."""
        m, k = self._check_q(q)
        if not self.rowwise_rows or (start, stop) == (0, m):
            return None
        return self._dequantize_parts(self._row_block(q, start, stop))

    def _row_block(self, q: QuantizedTensor, start: int, stop: int, device: torch.device | None = None
                   ) -> QuantizedTensor:
        """Rows [start, stop) of q as a QuantizedTensor of their own (views of q's rowwise buffers,
        copied to `device` when given)."""
        m, k = flat_dims(q.shape)
        if start % self.row_block_multiple or not 0 <= start < stop <= m:
            raise FormatError(f"{self.name}: rows [{start}, {stop}) are not a row block of a {m}-row tensor")
        buffers = {name: q.buffers[name] for name in self.glob_keys}
        for name, (axis, per_entry) in self.rowwise_rows.items():
            first, last = start // per_entry, -(-stop // per_entry)
            buffers[name] = q.buffers[name].narrow(axis, first, last - first)
        if device is not None:
            buffers = {name: t.to(device, non_blocking=True) for name, t in buffers.items()}
        return QuantizedTensor(self.name, (stop - start, k), buffers, self.valid_regions((stop - start, k)))

    def _dequantize_parts(self, q: QuantizedTensor) -> DequantizeParts | None:
        """(f, tensors) with f(*tensors) == _dequantize(q) in the (M, K) shape; None by default."""
        return None

    def dequantize_columnwise(self, q: QuantizedTensor) -> torch.Tensor:
        """float32 tensor of q.shape from the columnwise buffers."""
        self._check_q(q)
        if not self.has_columnwise:
            raise FormatError(f"{self.name}: this format has no columnwise buffers")
        return self._dequantize_columnwise(q).reshape(q.shape)

    def to_rows(self, q: QuantizedTensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(rows, glob): every buffer in row layout (dim 0 = groups of rows_per_entry[key] rows of
        the flattened tensor, padding removed, contiguous) and the per-tensor values."""
        self._check_q(q)
        rows, glob = self._to_rows(q)
        return ({k: v.contiguous() for k, v in rows.items()},
                {k: v.contiguous() for k, v in glob.items()})

    def row_views(self, q: QuantizedTensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """to_rows' buffers as views (not made contiguous): for reading their sizes without a copy."""
        self._check_q(q)
        return self._to_rows(q)

    def from_rows(self, rows: dict[str, torch.Tensor], glob: dict[str, torch.Tensor],
                  shape) -> QuantizedTensor:
        """Rebuild the full TE-layout QuantizedTensor from to_rows()'s output for a tensor of
        `shape`. Raises FormatError naming the buffer if any key, dtype or shape is wrong (a
        mis-sized gather is an error, never trimmed or padded to fit)."""
        shape = tuple(int(s) for s in shape)
        self.check(shape, torch.float32)
        self._check_layout("rows", rows, self.row_specs(shape))
        self._check_layout("glob", glob, self.glob_specs())
        return self._from_rows(rows, glob, shape)

    def dequantize_row_layout(self, rows: dict[str, torch.Tensor], glob: dict[str, torch.Tensor],
                              shape) -> torch.Tensor:
        """float32 tensor of `shape` from to_rows()'s output: `dequantize(from_rows(rows, glob, shape))`
        bit for bit, checked alike, without rebuilding the buffers the rowwise dequantization does not
        read where the format says how (`_dequantize_row_layout`). A subclass parameter dequantizes
        this way for every op it does not handle, so each of torch.compile's traces of it records only
        the dequantization's own ops (the TE layout's padding, transposes and columnwise copies were
        most of them)."""
        shape = tuple(int(s) for s in shape)
        self.check(shape, torch.float32)
        self._check_layout("rows", rows, self.row_specs(shape))
        self._check_layout("glob", glob, self.glob_specs())
        return self._dequantize_row_layout(rows, glob, shape).reshape(shape)

    def derived_views(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The buffers of q whose bytes the format lays out as another buffer's, rearranged: each as
        a view of that buffer (e.g. fp8_block's columnwise data, its rowwise data transposed), so
        that a holder of q may keep one copy where its bits agree. None by default."""
        return {}

    def row_specs(self, shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Expected (shape, dtype) of each tensor of to_rows()'s first dict for a tensor of `shape`."""
        raise NotImplementedError

    def glob_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: ((1,), torch.float32) for k in self.glob_keys}

    def buffer_specs(self, shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each TE buffer for a tensor of `shape`."""
        raise NotImplementedError

    def valid_regions(self, shape) -> dict[str, tuple[slice, ...]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Format {self.name} row_block={self.row_block}>"

    # ---------------------------------------------------------------- helpers

    def _check_amax(self, amax, device) -> torch.Tensor:
        if not isinstance(amax, torch.Tensor):
            amax = torch.tensor([float(amax)], dtype=torch.float32)
        if amax.numel() != 1 or not amax.dtype.is_floating_point:
            raise FormatError(f"{self.name}: amax must be a floating-point scalar tensor, "
                              f"got {amax.dtype}{tuple(amax.shape)}")
        amax = amax.detach().to(device=device, dtype=torch.float32).reshape(1)
        if not bool(torch.isfinite(amax).all() & (amax >= 0).all()):
            raise FormatError(f"{self.name}: amax must be finite and >= 0, got {float(amax[0])}")
        return amax

    def _check_layout(self, what: str, got: dict, specs: dict) -> None:
        if not isinstance(got, dict) or set(got) != set(specs):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise FormatError(f"{self.name}: {what} keys {keys} != expected {sorted(specs)}")
        for key, (shape, dtype) in specs.items():
            t = got[key]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                desc = f"{t.dtype}{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise FormatError(f"{self.name}: {what}[{key!r}] is {desc}, expected "
                                  f"{dtype}{tuple(shape)}")

    def _quantize_in_row_blocks(self, x2: torch.Tensor, amax: torch.Tensor, shape) -> QuantizedTensor:
        """The row layout of each block (quantized with the whole tensor's amax), concatenated and
        laid out as one tensor: the same bits as one pass, with block-sized temporaries."""
        k = x2.shape[1]
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in self.rows_per_entry}
        glob: dict[str, torch.Tensor] = {}
        for start, stop in self.row_blocks(shape):
            rows, glob = self._to_rows(self._quantize(x2[start:stop], amax, (stop - start, k)))
            for name in pieces:
                pieces[name].append(rows[name].contiguous())
        joined = {}
        for name in list(pieces):
            joined[name] = torch.cat(pieces.pop(name))
        return self.from_rows(joined, glob, shape)

    def _make(self, shape: tuple[int, ...], buffers: dict[str, torch.Tensor]) -> QuantizedTensor:
        return QuantizedTensor(self.name, tuple(shape), buffers, self.valid_regions(shape))

    # hooks
    def _quantize(self, x2: torch.Tensor, amax: torch.Tensor, shape: tuple[int, ...]) -> QuantizedTensor:
        raise NotImplementedError

    def _dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize_columnwise(self, q: QuantizedTensor) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize_row_layout(self, rows, glob, shape) -> torch.Tensor:
        """float32 (M, K) of the row layout: `_dequantize(_from_rows(...))` unless a format reads its
        rowwise buffers from the row layout itself (every built-in one does)."""
        return self._dequantize(self._from_rows(rows, glob, shape))

    def _to_rows(self, q: QuantizedTensor):
        raise NotImplementedError

    def _from_rows(self, rows, glob, shape) -> QuantizedTensor:
        raise NotImplementedError
