"""How a case configures FSDP2: the `fully_shard` arguments and mesh training code really uses.

A configuration is one id component after the seed, tokens joined by "+", absent when FSDP2 runs
with its defaults (so every id written before this dimension existed still means the same case):

    reference:nvfp4_2d:136x64:bf16:ws4:gather:s0:mp-bf16+raf-2+hsdp-2x2

  mp-P[-rR]   MixedPrecisionPolicy(param_dtype=P, reduce_dtype=R), P and R in bf16/fp32
  raf-no      reshard_after_forward=False;  raf-N: reshard_after_forward=N (an int)
  hsdp-RxS    a 2-D ("replicate", "shard") DeviceMesh of R x S ranks (R * S = the world size)
  tp-DxT      tensor parallel + FSDP2 on a 2-D ("dp", "tp") DeviceMesh of D x T ranks (D * T = the world
              size): the weight distributed on "tp" with torch's ColwiseParallel (Shard(0): each TP rank
              holds M / T rows), then fully_shard on "dp" (FSDP2 shards each TP piece's rows over D ranks)
  tp-DxT-row  the same with RowwiseParallel (Shard(1): each TP rank holds K / T columns)
  dim1        shard_placement_fn puts Shard(1) on the weight (shards along K)
  compile     torch.compile of the module's forward around the gathered weight
  dcp-wsA     the sharded weight saved with torch.distributed.checkpoint at world size A, loaded here
              (with tp-DxT: saved at tp-(A/T)xT, the same TP split over another dp size)
  dcp-wsA-trained   the same, saved after one training forward of the module at A (as a training
              run saves it: e.g. TE's DelayedScaling then carries its amax history in _extra_state)
  nested      the block scenario's block sharded inside a model root with a parameter of its own
              (fully_shard(block), then fully_shard(root)); without it the block is the root
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from qgather.errors import UsageError

MP_DTYPES = ("bf16", "fp32")
#: torch's tensor-parallel styles of a linear weight: colwise (token tp-DxT) Shard(0), rowwise (tp-DxT-row) Shard(1)
TP_STYLES = ("col", "row")


class ConfigError(UsageError):
    """A configuration token that does not describe an FSDP2 configuration."""


@dataclass(frozen=True)
class FsdpConfig:
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool | int = True
    hsdp: tuple[int, int] | None = None  # (replicate, shard)
    tp: tuple[int, int] | None = None  # (dp, tp): the ("dp", "tp") mesh of tensor parallel + FSDP2
    tp_style: str = "col"  # "col": ColwiseParallel, Shard(0); "row": RowwiseParallel, Shard(1)
    shard_dim: int = 0
    compile: bool = False
    saved_at_world_size: int | None = None
    saved_after_forward: bool = False
    nested: bool = False  # the block scenario: the block inside a fully_shard-ed model root

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in MP_DTYPES:
                raise ConfigError(f"{name} {value!r} is not one of {', '.join(MP_DTYPES)}")
        if self.reduce_dtype is not None and self.param_dtype is None:
            raise ConfigError("a reduce dtype needs a param dtype (mp-P-rR)")
        if self.shard_dim not in (0, 1):
            raise ConfigError(f"shard dim {self.shard_dim} is not 0 or 1")
        if self.hsdp is not None and min(self.hsdp) < 1:
            raise ConfigError(f"hsdp mesh {self.hsdp} needs positive sizes")
        if self.saved_at_world_size is not None and self.saved_at_world_size < 1:
            raise ConfigError(f"dcp-ws{self.saved_at_world_size}: a world size is >= 1")
        self._check_tensor_parallel()
        if self.saved_after_forward and self.saved_at_world_size is None:
            raise ConfigError("saved after a forward needs a checkpoint (dcp-wsA-trained)")
        raf = self.reshard_after_forward
        if not isinstance(raf, bool) and raf < 1:
            raise ConfigError(f"reshard_after_forward={raf}: an int must be >= 1")

    def _check_tensor_parallel(self) -> None:
        if self.tp_style not in TP_STYLES:
            raise ConfigError(f"tensor-parallel style {self.tp_style!r} is not one of {', '.join(TP_STYLES)}")
        if self.tp is None:
            if self.tp_style != "col":
                raise ConfigError("a rowwise style needs a tensor-parallel mesh (tp-DxT-row)")
            return
        if min(self.tp) < 1:
            raise ConfigError(f"tp mesh {self.tp} needs positive sizes")
        if self.hsdp is not None:
            raise ConfigError("tp-DxT and hsdp-RxS each make the case's 2-D mesh: one of them per case")
        if self.shard_dim != 0:
            raise ConfigError("tp-DxT: FSDP2 shards each TP piece along dim 0 (dim1 is not combined with tp)")
        saved = self.saved_at_world_size
        if saved is not None and saved % self.tp[1]:
            raise ConfigError(f"dcp-ws{saved} with tp-{self.tp[0]}x{self.tp[1]}: the checkpoint is saved with the "
                              f"same tp size {self.tp[1]}, so its world size must be a multiple of it")

    @property
    def saved_config(self) -> FsdpConfig:
        """The configuration the checkpoint of a dcp-wsA case is saved under, at world size A: no
        checkpoint of its own, no compile, and under tp-DxT the same TP split over A / T dp ranks."""
        tp = None if self.tp is None else (self.saved_at_world_size // self.tp[1], self.tp[1])
        return replace(self, saved_at_world_size=None, saved_after_forward=False, compile=False, tp=tp)

    @property
    def is_default(self) -> bool:
        # by token, not ==: reshard_after_forward=1 (an int) compares equal to True
        return not self.token

    @property
    def token(self) -> str:
        """The id component ("" for FSDP2's defaults)."""
        parts = []
        if self.param_dtype:
            parts.append(f"mp-{self.param_dtype}" + (f"-r{self.reduce_dtype}" if self.reduce_dtype else ""))
        if self.reshard_after_forward is False:
            parts.append("raf-no")
        elif self.reshard_after_forward is not True:
            parts.append(f"raf-{self.reshard_after_forward}")
        if self.hsdp:
            parts.append(f"hsdp-{self.hsdp[0]}x{self.hsdp[1]}")
        if self.tp:
            parts.append(f"tp-{self.tp[0]}x{self.tp[1]}" + ("-row" if self.tp_style == "row" else ""))
        if self.shard_dim == 1:
            parts.append("dim1")
        if self.compile:
            parts.append("compile")
        if self.saved_at_world_size is not None:
            parts.append(f"dcp-ws{self.saved_at_world_size}" + ("-trained" if self.saved_after_forward else ""))
        if self.nested:
            parts.append("nested")
        return "+".join(parts)

    def check_world_size(self, world_size: int) -> str | None:
        """Why this configuration cannot run at `world_size`, or None."""
        if self.hsdp and self.hsdp[0] * self.hsdp[1] != world_size:
            ranks = self.hsdp[0] * self.hsdp[1]
            return f"hsdp-{self.hsdp[0]}x{self.hsdp[1]} needs {ranks} ranks, the case has {world_size}"
        if self.tp and self.tp[0] * self.tp[1] != world_size:
            ranks = self.tp[0] * self.tp[1]
            return f"tp-{self.tp[0]}x{self.tp[1]} needs {ranks} ranks (dp x tp), the case has {world_size}"
        return None

    @classmethod
    def parse(cls, token: str) -> FsdpConfig:
        fields: dict = {}
        for part in filter(None, token.split("+")):
            _parse_part(part, fields)
        return cls(**fields)


DEFAULT = FsdpConfig()

_PATTERNS: list[tuple[re.Pattern, object]] = [
    (re.compile(r"mp-(\w+?)(?:-r(\w+))?"), lambda m: {"param_dtype": m[1], "reduce_dtype": m[2]}),
    (re.compile(r"raf-no"), lambda m: {"reshard_after_forward": False}),
    (re.compile(r"raf-(\d+)"), lambda m: {"reshard_after_forward": int(m[1])}),
    (re.compile(r"hsdp-(\d+)x(\d+)"), lambda m: {"hsdp": (int(m[1]), int(m[2]))}),
    (re.compile(r"tp-(\d+)x(\d+)(-row)?"),
     lambda m: {"tp": (int(m[1]), int(m[2])), "tp_style": "row" if m[3] else "col"}),
    (re.compile(r"dim1"), lambda m: {"shard_dim": 1}),
    (re.compile(r"compile"), lambda m: {"compile": True}),
    (re.compile(r"dcp-ws(\d+)(-trained)?"),
     lambda m: {"saved_at_world_size": int(m[1]), "saved_after_forward": m[2] is not None}),
    (re.compile(r"nested"), lambda m: {"nested": True}),
]


def _parse_part(part: str, fields: dict) -> None:
    for pattern, read in _PATTERNS:
        match = pattern.fullmatch(part)
        if match:
            values = read(match)
            if set(values) & set(fields):
                raise ConfigError(f"configuration token {part!r} repeats a setting")
            fields.update(values)
            return
    raise ConfigError(f"configuration token {part!r} is not one of mp-P[-rR], raf-no, raf-N, hsdp-RxS, "
                      "tp-DxT[-row], dim1, compile, dcp-wsA[-trained], nested")
