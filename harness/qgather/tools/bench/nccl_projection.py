"""What a large case would cost on NCCL, from a run on one GPU (`qgather bench gpu`).

On one GPU the ranks all-gather through gloo, which copies through the host: its collective takes
a good part of a second where NCCL moves the same bytes in well under a millisecond. The
projection replaces the measured collective by NCCL's time for the same bytes at an assumed
all-gather bus bandwidth (`BUS_BANDWIDTH`, printed with every result), in the case and in the bare
work alike. The collective taken out of a case is the one that case's own run measured on each
rank (its seconds in the collective once the last rank had arrived): a case's overhead is a few
milliseconds beside a gloo all-gather of a few hundred, and the spread of two separate
all-gathers is larger than that, so subtracting another measurement's collective projected noise
(ratios from 0.1 to 11 for one case in one session). Per rank r of the run:

    projected case = max over r of (the run's seconds on r - r's own collective) + NCCL collective
    projected bare = the library's shard quantization (and module build) + NCCL collective

NCCL's bus bandwidth follows nccl-tests' definition: an all-gather of S output bytes over n ranks
moves S * (n - 1) / n bytes through each rank's links, so its time is that over the bus bandwidth.

The HBM floor says how far each step is from the card's memory bandwidth: the bytes each step
must at least read and write (a model over the tensors it touches, not a hardware counter) over the
card's bandwidth (`HBM_BANDWIDTH`, by the card's name).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qgather.model.phases import Phase, Step

#: NVLink4 all-gather bus bandwidth on H100/H200, as nccl-tests reports it (bytes/s)
BUS_BANDWIDTH = 370e9
BUS_BANDWIDTH_SOURCE = "NVLink4 all-gather bus bandwidth of H100/H200, nccl-tests' busbw (assumed)"
#: HBM bandwidth by card name (bytes/s, the vendors' figures)
HBM_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
DEFAULT_HBM_BANDWIDTH = 3.35e12


def nccl_all_gather_s(bytes_per_rank: int, world_size: int, bus_bandwidth: float = BUS_BANDWIDTH) -> float:
    """NCCL's time for an all-gather of `bytes_per_rank` from each of `world_size` ranks."""
    if world_size < 2:
        return 0.0
    total = bytes_per_rank * world_size
    return total * (world_size - 1) / world_size / bus_bandwidth


@dataclass(frozen=True)
class RankRun:
    """One rank's seconds in one run of a case: the whole run, and its own collective in it (from the
    last rank's arrival on: the wait for the others is the work of the rank that came last)."""

    rank: int
    run_s: float
    collective_s: float


@dataclass(frozen=True)
class Projection:
    """A case and its bare work, measured on one backend and projected onto NCCL: `case_s` and
    `measured_collective_s` are the run's and its collective's seconds on the rank whose projection
    is the longest."""

    case_s: float
    bare_quantize_s: float
    measured_collective_s: float  # the case's own collective on that rank, on the backend that ran
    nccl_collective_s: float
    rank: int = 0

    @property
    def case_on_nccl_s(self) -> float:
        return max(self.case_s - self.measured_collective_s, 0.0) + self.nccl_collective_s

    @property
    def bare_on_nccl_s(self) -> float:
        return self.bare_quantize_s + self.nccl_collective_s

    @property
    def ratio(self) -> float:
        return self.case_on_nccl_s / self.bare_on_nccl_s if self.bare_on_nccl_s else float("inf")


def project(ranks: Sequence[RankRun], bare_quantize_s: float, bytes_per_rank: int, world_size: int,
            bus_bandwidth: float = BUS_BANDWIDTH) -> Projection:
    """The case's run on each rank with its own collective swapped for NCCL's; the longest rank's."""
    if not ranks:
        raise ValueError("a projection needs the run of at least one rank")
    longest = max(ranks, key=lambda r: r.run_s - r.collective_s)
    return Projection(longest.run_s, bare_quantize_s, longest.collective_s,
                      nccl_all_gather_s(bytes_per_rank, world_size, bus_bandwidth), longest.rank)


def hbm_bandwidth(device_name: str) -> tuple[float, str]:
    """The card's HBM bandwidth (bytes/s) and what it was taken for."""
    for card, bandwidth in HBM_BANDWIDTH.items():
        if card in device_name:
            return bandwidth, f"{card} HBM, {bandwidth / 1e12:.2f} TB/s"
    return DEFAULT_HBM_BANDWIDTH, f"unknown card {device_name!r}: assumed {DEFAULT_HBM_BANDWIDTH / 1e12:.2f} TB/s"


def step_floor_bytes(weight_bytes: int, quantized_bytes: int, world_size: int,
                     own_quantizer: bool) -> dict[str, int]:
    """The bytes each step of a gather case reads and writes at least, per rank (W: the weight in
    its dtype, Q: its quantization with every buffer):

      one-device twin   the library quantizes W (W + Q) and its forward reads the rowwise half (Q/2)
      golden            the reference quantizes W (W + Q); an own quantizer again, and the two compared (W + 3Q)
      sharded module    the shard quantized (W/n + Q/n)
      collective        the shard in, the gathered weight out, copied in and out of FSDP2's buffer (2Q/n + 2Q)
      inspection        both sides' buffers compared and fingerprinted (3Q), both dequantized in float32
                        and compared (2Q + 3 * 4 bytes per element ~ 6W), the layer outputs (2Q)
    """
    w, q, n = weight_bytes, quantized_bytes, max(world_size, 1)
    golden = w + q + (w + 3 * q if own_quantizer else 0)
    return {Step.TWIN.value: w + q + q // 2, Step.GOLDEN.value: golden, Step.SHARDED_MODULE.value: (w + q) // n,
            Phase.COLLECTIVE.value: 2 * q // n + 2 * q, Phase.INSPECTION.value: 3 * q + 2 * q + 6 * w + 2 * q}
