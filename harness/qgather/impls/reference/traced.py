"""The reference's dequantization as one operator of its own (`qgather::dequantize_row_layout`), the op
its `__torch_dispatch__` runs for every op it does not handle.

Under torch.compile, Dynamo and AOTAutograd trace the parameter's dispatch three to four times per
graph (Dynamo's fake run, AOTAutograd's metadata pass, its subclass pass and the graph capture), each
through fake tensors, functionalization and the proxy tracer, op by op: a dequantization written in a
dozen tensor ops was about half of a compiled forward's time. As one custom op it is traced as one node
whose output is declared by its fake implementation (the float32 shape), and run in the graph by the
same eager code as outside it (`Format.dequantize_row_layout`), so the compiled forward's values are
the eager ones by construction under any backend. What compile exercises of the subclass is unchanged:
`__tensor_flatten__`, `__tensor_unflatten__` (the op reads the tensors the rebuilt parameter holds) and
the graph around it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from qgather.formats import Format

#: the formats the op was called with, by key (name and identity: a zoo mutant's format subclass keeps
#: its built-in name); a key names the same live object for as long as the op can be called with it
_FORMATS: dict[str, Format] = {}
_SEP = ","


def dequantized(fmt: Format, rows: dict[str, torch.Tensor], glob: dict[str, torch.Tensor],
                shape: tuple[int, ...]) -> torch.Tensor:
    """`fmt.dequantize_row_layout(rows, glob, shape)`: through the custom op while a tracer's tensors or
    dispatch mode are in play, else called directly (the op's first eager call in a process without
    torch._dynamo loaded imports it: about a second)."""
    tensors = [*rows.values(), *glob.values()]
    if _get_current_dispatch_mode() is None and all(type(t) is torch.Tensor for t in tensors):
        return fmt.dequantize_row_layout(rows, glob, shape)
    return through_op(fmt, rows, glob, shape)


def through_op(fmt: Format, rows: dict[str, torch.Tensor], glob: dict[str, torch.Tensor],
               shape: tuple[int, ...]) -> torch.Tensor:
    """`fmt.dequantize_row_layout(rows, glob, shape)` as one call of the custom op."""
    key = f"{fmt.name}@{id(fmt)}"
    _FORMATS[key] = fmt
    return _dequantize_row_layout(key, _SEP.join([*rows, *glob]), [*rows.values(), *glob.values()], len(rows),
                                  list(shape))


@torch.library.custom_op("qgather::dequantize_row_layout", mutates_args=())
def _dequantize_row_layout(fmt_key: str, names: str, tensors: list[torch.Tensor], n_rows: int,
                           shape: list[int]) -> torch.Tensor:
    pairs = list(zip(names.split(_SEP), tensors))
    out = _FORMATS[fmt_key].dequantize_row_layout(dict(pairs[:n_rows]), dict(pairs[n_rows:]), tuple(shape))
    # an op's output may not alias its inputs (a format of one's own may return a view of its storage),
    # and it is laid out as the fake implementation declares it: contiguous
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    return out.clone() if out.numel() and out.untyped_storage().data_ptr() in storages else out.contiguous()


@_dequantize_row_layout.register_fake
def _(fmt_key: str, names: str, tensors: list[torch.Tensor], n_rows: int, shape: list[int]) -> torch.Tensor:
    return tensors[0].new_empty(shape, dtype=torch.float32)
