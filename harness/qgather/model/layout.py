"""Whether a case's shards fit its format's scale blocks: shape arithmetic for the verdict policy.

A shard that starts off the format's row block (or, under Shard(1), off its column block) cannot be
quantized or gathered exactly without the other ranks' rows: there a REJECTED verdict is acceptable
(qgather.model.verdict.expectation). Nothing here touches a tensor or a process group.
"""

from __future__ import annotations

from qgather.formats import FORMATS, FormatError
from qgather.model.case import CaseSpec, ColumnShardLayout, ShardLayout, shard_layout, tensor_parallel_layout


def column_block(fmt_name: str) -> int:
    """Columns a dim-1 shard must start on: the K extent of the format's scale blocks."""
    fmt = FORMATS[fmt_name]
    if fmt_name.startswith("fp8_block"):
        return 128
    return max(1, fmt.k_multiple)


def tensor_parallel_problem(spec: CaseSpec) -> str | None:
    """Why the case's TP split cuts the format's scale blocks (None: aligned or no tp): a piece that
    starts off the row block (colwise) or the column block (rowwise) has no slice of the one-device
    quantization, and a piece the format cannot hold (its K or M off the format's multiple) neither."""
    tp = tensor_parallel_layout(spec)
    if tp is None:
        return None
    fmt = FORMATS[spec.fmt]
    block = fmt.row_block if tp.dim == 0 else column_block(spec.fmt)
    what = "row" if tp.dim == 0 else "column"
    for rank in range(tp.size):
        start, end = tp.piece_range(rank)
        if end > start and start % block:
            return (f"tp rank {rank}'s piece starts at {what} {start}, not a multiple of the {block}-{what} "
                    f"scale block of {spec.fmt}")
    try:
        fmt.check(tp.piece_shape(), spec.torch_dtype)
    except FormatError as exc:
        return f"the tp piece {tp.piece_shape()} cannot be held: {exc}"
    return None


def alignment_problem(spec: CaseSpec) -> str | None:
    """Why the case's shards violate the format's blocks (None: aligned), for the verdict policy.
    Under tensor parallelism: the TP split, then FSDP2's split of each TP piece over "dp"."""
    problem = tensor_parallel_problem(spec)
    if problem:
        return problem
    layout, fmt = shard_layout(spec), FORMATS[spec.fmt]
    if isinstance(layout, ColumnShardLayout):
        block = column_block(spec.fmt)
        rank = layout.misaligned_rank(block)
        if rank is not None:
            return f"rank {rank}'s dim-1 shard starts at column {layout.col_range(rank)[0]}, not a multiple of {block}"
        # FSDP2 (torch 2.13, FSDPParam._init_sharded_post_forward_param_metadata) also chunks a Shard(1)
        # parameter along dim 0 over the shard mesh: a subclass may refuse that split as it refuses any.
        rows = ShardLayout(spec.shape[0], layout.world_size, spec.inner_rows)
        rank = rows.misaligned_rank(fmt.row_block)
        if rank is None:
            return None
        return (f"FSDP2 chunks a Shard(1) parameter along dim 0 too (post-forward metadata): rank {rank}'s rows "
                f"start at {rows.row_range(rank)[0]}, not a multiple of {fmt.row_block}")
    rank = layout.misaligned_rank(fmt.row_block)
    if rank is None:
        return None
    if spec.config.tp:
        return (f"dp rank {rank}'s shard of each tp piece starts at row {layout.row_range(rank)[0]} of the piece, "
                f"not a multiple of {fmt.row_block}")
    return f"rank {rank}'s shard starts at row {layout.row_range(rank)[0]}, not a multiple of {fmt.row_block}"
