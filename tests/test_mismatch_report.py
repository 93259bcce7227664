"""A deliberately broken hook gets the right verdict AND the right report.

The expected numbers are derived here, not copied from a run: where a mismatch lands follows from
the shard geometry (argued in each test), and how many elements differ comes from re-enacting the
bug on one process with the reference formats, independently of the harness's comparison code.
"""

from __future__ import annotations

import re

import torch

from qgather.formats import FORMATS
from qgather.model.case import CaseSpec
from qgather.model.verdict import Verdict
from qgather.scenarios.data import make_gradient, make_weight
from qgather.scenarios.fsdp import LEARNING_RATE
from qgather.tools import selftest

NVFP4_2D = FORMATS["nvfp4_2d"]
BLOCK = 16


def _stepped_weight(spec: CaseSpec) -> torch.Tensor:
    """The full weight after the scenario's first SGD step (what both the shards and the golden see)."""
    param = torch.nn.Parameter(make_weight(spec))
    opt = torch.optim.SGD([param], lr=LEARNING_RATE, momentum=0.9)
    param.grad = make_gradient(spec, 1)
    opt.step()
    return param.detach().to(spec.torch_dtype)


def _n_diff(got, want, name: str) -> int:
    region = want.valid[name]
    a, b = got.buffers[name][region], want.buffers[name][region]
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def _where_line(text: str, buffer: str) -> str:
    match = re.search(rf"^\s*{buffer}: \d+ of \d+ row groups differ; .*$", text, re.M)
    assert match, f"no location line for {buffer} in:\n{text}"
    return match.group(0).strip()


def _map_after(text: str, buffer: str) -> str:
    """The block-row map printed under a buffer's location line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{buffer}: ") and "row groups" in line)
    assert "block rows (16 rows each" in lines[start + 1]
    return lines[start + 2].split()[-1]


def test_misaligned_shard_report_maps_the_straddling_tiles_to_their_ranks():
    case = "mutant:misaligned_shard:nvfp4_2d:144x64:bf16:ws8:reshard:s0"
    spec = CaseSpec.parse(case)
    report = selftest.run(case)
    text = report.render()
    assert report.verdict is Verdict.SILENT_MISMATCH, text
    # The first unshard slices the full quantization, exact even at row 18 (2D scales are stored per
    # row); the mismatch appears only once step 1 re-quantizes each shard on its own tile grid.
    assert report.reason.startswith("unshard 2 (after step 1): rowwise_data: "), text

    # Re-enact: 8 shards of 18 rows, each quantized on its own with the (all-reduced) global amax.
    w1 = _stepped_weight(spec)
    golden = NVFP4_2D.quantize(w1)
    pieces = [NVFP4_2D.to_rows(NVFP4_2D.quantize(w1[r * 18:(r + 1) * 18], amax=w1.abs().amax().float()))
              for r in range(8)]
    rows = {n: torch.cat([p[0][n] for p in pieces]) for n in pieces[0][0]}
    gathered = NVFP4_2D.from_rows(rows, pieces[0][1], (144, 64))
    for name, valid_numel in (("rowwise_data", 144 * 32), ("rowwise_scale_inv", 144 * 4),
                              ("columnwise_data", 64 * 72), ("columnwise_scale_inv", 64 * 9)):
        n = _n_diff(gathered, golden, name)
        assert n > 0
        assert f"{name}: {n} of {valid_numel} valid elements differ" in text, text
    assert "amax_rowwise" not in text  # the amax was all-reduced: only the tiles are wrong

    # Geometry: global tile t covers rows [16t, 16t+16); rank r's local tiles start at 18r and
    # 18r+16. Only tile 0 coincides with a local tile (rank 0's first), every other one straddles:
    # block rows 1..8 differ, each marked with the rank holding its first row, 16b // 18.
    owners = "".join(str(16 * b // 18) for b in range(1, 9))
    assert owners == "01234567"
    for name in ("rowwise_data", "rowwise_scale_inv"):
        assert _map_after(text, name) == "." + owners, text
    # Rows 16..143 all differ (each row's codes were scaled by a straddling tile): 128 of 144.
    # The first is row 16, tile 1, whose first row rank 0 holds; its first differing byte gives the
    # block column (8 packed bytes = 16 values per scale).
    first = (gathered.buffers["rowwise_data"][16] != golden.buffers["rowwise_data"][16]).nonzero()[0].item()
    assert _where_line(text, "rowwise_data") == (
        f"rowwise_data: 128 of 144 row groups differ; first at global row 16 "
        f"(block row 1, block column {first // 8}, from rank 0)")
    assert "expected EXACT or REJECTED (rank 1's shard starts at row 18, not a multiple of 16)" in text
    assert text.splitlines()[-1] == f"  reproduce: qgather case {case} --device cpu --backend gloo"  # the run's options


def test_per_rank_amax_report_shows_the_cross_rank_picture():
    case = "mutant:per_rank_amax:nvfp4_2d:128x64:bf16:ws2:reshard:s0"
    spec = CaseSpec.parse(case)
    report = selftest.run(case)
    text = report.render()
    assert report.verdict is Verdict.RANK_DIVERGENCE, text
    assert report.reason == "unshard 2 (after step 1): ranks hold 2 different gathered results", text

    # Row magnitudes grow from 2^-6 to 2^6 down the weight, so the global amax lies in rank 1's
    # rows: rank 1's local amax IS the global one, rank 0's is far smaller. Each rank's metadata
    # carries its own amax, so the two unsharded weights differ (in the amax at least): two groups.
    w1 = _stepped_weight(spec)
    halves = (w1[:64], w1[64:])
    assert halves[1].abs().amax() == w1.abs().amax() > 16 * halves[0].abs().amax()
    assert "ranks grouped by identical gathered buffers: [0]; [1]" in text, text

    # Rank 0's view, re-enacted: each half quantized with its own amax, rank 0's amax everywhere.
    golden = NVFP4_2D.quantize(w1)
    pieces = [NVFP4_2D.to_rows(NVFP4_2D.quantize(h)) for h in halves]
    rows = {n: torch.cat([p[0][n] for p in pieces]) for n in pieces[0][0]}
    rank0 = NVFP4_2D.from_rows(rows, pieces[0][1], (128, 64))
    for name, valid_numel in (("rowwise_data", 4096), ("rowwise_scale_inv", 512),
                              ("columnwise_data", 4096), ("columnwise_scale_inv", 512)):
        assert f"rank 0: {name}: {_n_diff(rank0, golden, name)} of {valid_numel} valid elements differ" in text
    # Every tile scale of rank 0's rows is 448 * tile_amax / local_amax instead of / global_amax,
    # a factor > 16 apart: all 64 rows x 4 blocks of rank 0's rowwise scales differ, none of rank 1's.
    assert _n_diff(rank0, golden, "rowwise_scale_inv") == 64 * 4
    assert "rank 0: amax_rowwise: 1 of 1 valid elements differ" in text
    assert _map_after(text, "rowwise_scale_inv") == "0000....", text
    assert _where_line(text, "rowwise_scale_inv") == (
        "rowwise_scale_inv: 64 of 128 row groups differ; first at global row 0 "
        "(block row 0, block column 0, from rank 0)")
    assert text.splitlines()[-1] == f"  reproduce: qgather case {case} --device cpu --backend gloo"  # the run's options


def test_nibble_swap_report_counts_the_bytes_whose_two_codes_differ():
    case = "mutant:nibble_swap:nvfp4_2d:128x64:bf16:ws2:gather:s0"
    spec = CaseSpec.parse(case)
    report = selftest.run(case)
    text = report.render()
    assert report.verdict is Verdict.SILENT_MISMATCH, text

    # Swapping the nibbles of a byte changes it exactly when its two FP4 codes differ; the scales
    # and amax are untouched, and the columnwise data derived from the swapped codes is wrong too.
    golden = NVFP4_2D.quantize(make_weight(spec).to(spec.torch_dtype))
    data = golden.buffers["rowwise_data"]
    swapped_bytes = (data & 0x0F) != (data >> 4)
    n_rowwise = int(swapped_bytes.sum())
    swapped = {"rowwise_data": ((data & 0x0F) << 4) | (data >> 4),
               "rowwise_scale_inv": NVFP4_2D.to_rows(golden)[0]["rowwise_scale_inv"]}
    gathered = NVFP4_2D.from_rows(swapped, NVFP4_2D.to_rows(golden)[1], (128, 64))
    n_columnwise = _n_diff(gathered, golden, "columnwise_data")
    assert report.reason == (f"unshard 1: rowwise_data: {n_rowwise} of 4096 valid elements differ; "
                             f"columnwise_data: {n_columnwise} of 4096 valid elements differ"), text
    assert "scale_inv: " not in text and "amax" not in text

    # Where: the first byte with two different codes, mapped to its row, 16-row block, scale column
    # (8 packed bytes per 16-value block) and the rank that held the row (64 rows per rank).
    row, col = (int(i) for i in swapped_bytes.nonzero()[0])
    rows_differing = int(swapped_bytes.any(dim=1).sum())
    assert _where_line(text, "rowwise_data") == (
        f"rowwise_data: {rows_differing} of 128 row groups differ; first at global row {row} "
        f"(block row {row // BLOCK}, block column {col // 8}, from rank {row // 64})")
    blocks = swapped_bytes.any(dim=1).view(8, BLOCK).any(dim=1).tolist()
    assert _map_after(text, "rowwise_data") == "".join(
        str(b * BLOCK // 64) if d else "." for b, d in enumerate(blocks)), text
    assert text.splitlines()[-1] == f"  reproduce: qgather case {case} --device cpu --backend gloo"  # the run's options


def test_a_shard_requantized_before_the_first_gather_is_judged_at_the_first_unshard():
    # the steps scenario re-quantizes every shard from its unchanged master rows before the first
    # unshard (an optimizer step or checkpoint load before any gather): a per-rank amax shows there
    report = selftest.run("mutant:per_rank_amax:nvfp4_2d:128x64:bf16:ws2:steps:s0")
    assert report.verdict is Verdict.RANK_DIVERGENCE, report.render()
    assert report.reason.startswith("unshard 1: "), report.render()
