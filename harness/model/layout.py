"""Whether a case's shards fit its format's scale blocks: shape arithmetic for the verdict policy.

A shard that starts off the format's row block (or, under Shard(1), off its column block) cannot be
quantized or gathered exactly without the other ranks' rows: there a REJECTED verdict is acceptable
(qgather.model.verdict.expectation). Nothing here touches a tensor or a process group.
"""

from __future__ import annotations

from qgather.formats import FORMATS
from qgather.model.case import CaseSpec, ColumnShardLayout, ShardLayout, shard_layout


def column_block(fmt_name: str) -> int:
    """Columns a dim-1 shard must start on: the K extent of the format's scale blocks."""
    fmt = FORMATS[fmt_name]
    if fmt_name.startswith("fp8_block"):
        return 128
    return max(1, fmt.k_multiple)


def alignment_problem(spec: CaseSpec) -> str | None:
    """Why the case's shards violate the format's blocks (None: aligned), for the verdict policy."""
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
    return f"rank {rank}'s shard starts at row {layout.row_range(rank)[0]}, not a multiple of {fmt.row_block}"
