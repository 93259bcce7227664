"""Digests of a weight's buffers, the same on every rank and device: sha256 over each buffer's name,
shape, dtype and valid bytes, or for a large buffer on a device a fingerprint computed where it lives
(two position-salted sums of its words), so that a large gathered weight is never copied to the host
to be hashed.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, on the CPU (read directly: numpy is not a dependency)."""
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


#: Device buffers larger than this are fingerprinted where they live (see `_fingerprint`) instead of
#: being copied to the host and hashed there, which costs more than the gather itself for large
#: weights. CPU buffers are always hashed byte by byte (sha256 is the faster of the two there).
LARGE_BUFFER_BYTES = 1 << 22
_DEVICE_CHUNK = 1 << 22  # elements per chunk of a fingerprint's loop: bounds its temporaries


def digest(buffers: dict[str, torch.Tensor], valid: dict[str, tuple[slice, ...]],
           known: dict[str, bytes] | None = None) -> str:
    """sha256 over every buffer's valid region (name, shape, dtype and bytes; a large device
    region's fingerprint instead of its bytes). `known`: `digest_part`s already computed for some of
    the buffers (a golden's, for buffers found bit-identical to it in the same shape and dtype)."""
    h = hashlib.sha256()
    for name in sorted(buffers):
        part = (known or {}).get(name)
        h.update(part if part is not None else digest_part(name, buffers[name], valid))
    return h.hexdigest()


def digest_part(name: str, t: torch.Tensor, valid: dict[str, tuple[slice, ...]]) -> bytes:
    """What `digest` hashes of one buffer: its name, shape and dtype, then its valid region's bytes,
    or for a large region on a device its fingerprint (`is_fingerprinted`)."""
    region = valid_region(name, t, valid)
    head = f"{name}:{tuple(t.shape)}:{t.dtype};".encode()
    if is_fingerprinted(region):
        return head + b"fingerprint:" + _fingerprint(region)
    return head + tensor_bytes(region)


def valid_region(name: str, t: torch.Tensor, valid: dict[str, tuple[slice, ...]]) -> torch.Tensor:
    """The part of buffer `name` that `digest` reads (padding left out)."""
    return t[valid[name]] if name in valid and t.dim() == len(valid[name]) else t


def is_fingerprinted(region: torch.Tensor) -> bool:
    """Whether `digest` fingerprints this region where it lives instead of hashing its bytes."""
    return region.device.type != "cpu" and region.numel() * region.element_size() > LARGE_BUFFER_BYTES


def _fingerprint(t: torch.Tensor) -> bytes:
    """Two sums over the region's 32-bit words, each word times an odd pseudo-random multiplier of
    its position (int64 arithmetic, wrapping): the same integers on every device, so ranks compare.
    A single differing word always changes both sums (an odd multiplier is invertible mod 2^64)."""
    words = _words(t)
    sums = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _DEVICE_CHUNK):
        chunk = words[start:start + _DEVICE_CHUNK].to(torch.int64)
        for k, salt in enumerate(_SALTS):
            sums[k] += (chunk * _multipliers(start, chunk.numel(), salt, t.device)).sum()
    return tensor_bytes(sums) + str(words.numel()).encode()


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -flat.numel() % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(torch.int32)


_SALTS = (0x2545F4914F6CDD1D, 0x1B873593)
_MASK = {s: (1 << (64 - s)) - 1 for s in (30, 27, 31)}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _multipliers(start: int, n: int, salt: int, device: torch.device) -> torch.Tensor:
    """splitmix64 of each position (logical shifts emulated on int64), forced odd."""
    z = torch.arange(start, start + n, dtype=torch.int64, device=device) + salt
    z = (z ^ ((z >> 30) & _MASK[30])) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 27) & _MASK[27])) * _signed(0x94D049BB133111EB)
    return (z ^ ((z >> 31) & _MASK[31])) | 1
