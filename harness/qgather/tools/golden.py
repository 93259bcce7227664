"""The golden corpus: stored inputs and quantized buffers, with a manifest.

`qgather golden` (make golden) writes one safetensors file per entry under golden/ (the input
weight and every quantized buffer) and golden/manifest.json (format, shape, dtype, seed,
producer, sha256 of every buffer). Producers:
  - `reference`: the harness's own formats (any machine);
  - `transformer_engine`: TE's quantizers on a GPU (`qgather golden --producer te` on the GPU
    host), the independent evidence that the reference formats are right.
`qgather golden --check` (and tests/test_golden.py) re-quantizes every stored input with the
reference formats and requires every buffer to match bit for bit.
An installed qgather reads the copy of golden/ that its build puts in the package (qgather.paths).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from qgather import __version__
from qgather.errors import QgatherError
from qgather.formats import FORMATS
from qgather.impls.te.quantizers import te_quantize
from qgather.instruments.digest import tensor_bytes
from qgather.model.case import torch_dtype_of
from qgather.paths import golden_dir
from qgather.tools.arguments import golden_parser

GOLDEN_DIR = golden_dir()
MANIFEST = "manifest.json"
MAX_CORPUS_BYTES = 5 * 1024 * 1024

# Small shapes with partial tiles and blocks where the format allows them.
ENTRY_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "fp8_tensor": [(64, 96)],
    "fp8_tensor_e5m2": [(64, 96)],
    "fp8_block": [(256, 128), (136, 200)],
    "fp8_block_1x128": [(256, 128), (136, 200)],
    "mxfp8": [(64, 96)],
    "nvfp4_1d": [(64, 96), (48, 80)],
    "nvfp4_2d": [(64, 96), (48, 80)],
}
ENTRY_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Entry:
    fmt: str
    shape: tuple[int, ...]
    dtype: str
    seed: int
    producer: str

    @property
    def file(self) -> str:
        shape = "x".join(map(str, self.shape))
        return f"{self.producer}/{self.fmt}_{shape}_{self.dtype}_s{self.seed}.safetensors"


def entry_seed(fmt: str, shape: tuple[int, ...], dtype: str) -> int:
    """The same input for every producer of an entry, so TE and reference files are comparable."""
    return zlib.crc32(f"{fmt}:{shape}:{dtype}".encode()) & 0xFFFF


def golden_input(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Values spanning many binades, exact zeros and a few ties: a demanding but finite input."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    x.view(-1)[:: 17] = 0.0
    return x.to(torch_dtype_of(dtype))


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def _producer_reference(fmt: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(FORMATS[fmt].quantize(x).buffers)


def _producer_te(fmt: str, x: torch.Tensor) -> dict[str, torch.Tensor] | None:
    return te_quantize(fmt, x.cuda())


def _producer_description(producer: str) -> dict:
    if producer == "reference":
        return {"producer": "reference", "harness": __version__, "torch": torch.__version__}
    import transformer_engine  # optional: only a TE producer reads its version

    return {
        "producer": "transformer_engine",
        "transformer_engine": transformer_engine.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }


def write(producer: str, out_dir: str = GOLDEN_DIR) -> list[str]:
    produce = {"reference": _producer_reference, "te": _producer_te}[producer]
    name = "reference" if producer == "reference" else "transformer_engine"
    manifest = load_manifest(out_dir)
    manifest["entries"] = [e for e in manifest["entries"] if e["producer"]["producer"] != name]
    notes = []
    for fmt, shapes in ENTRY_SHAPES.items():
        for shape in shapes:
            for dtype in ENTRY_DTYPES:
                entry = Entry(fmt, shape, dtype, seed=entry_seed(fmt, shape, dtype), producer=name)
                x = golden_input(shape, dtype, entry.seed)
                try:
                    buffers = produce(fmt, x)
                except Exception as exc:  # noqa: BLE001 - e.g. a TE kernel that needs a newer GPU
                    notes.append(f"{name} {fmt} {shape} {dtype}: not produced ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:160]})")
                    continue
                buffers = {k: v.detach().cpu().contiguous() for k, v in buffers.items()}
                path = os.path.join(out_dir, entry.file)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                save_file({"input": x.contiguous(), **buffers}, path)
                manifest["entries"].append({
                    "file": entry.file, "format": fmt, "shape": list(shape), "dtype": dtype,
                    "seed": entry.seed, "producer": _producer_description(producer),
                    "sha256": {k: sha256(v) for k, v in sorted(buffers.items())},
                })
    manifest["notes"] = sorted({*[n for n in manifest.get("notes", []) if not n.startswith(name)], *notes})
    save_manifest(manifest, out_dir)
    return notes


class ManifestError(QgatherError, ValueError):
    """golden/manifest.json is missing, unreadable or has no entries."""


def read_manifest(out_dir: str = GOLDEN_DIR) -> dict:
    """The manifest to check: a missing, invalid or empty one is an error, not a green check of nothing."""
    path = os.path.join(out_dir, MANIFEST)
    try:
        with open(path) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (write one with `qgather golden`)") from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc})") from None
    entries = manifest.get("entries") if isinstance(manifest, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ManifestError(f"{path}: no entries to check")
    return manifest


def check_entry_safely(entry, out_dir: str = GOLDEN_DIR) -> list[str]:
    """check_entry, with a malformed entry or unreadable file reported as one problem line."""
    name = entry.get("file", "<entry without 'file'>") if isinstance(entry, dict) else repr(entry)[:60]
    try:
        if not isinstance(entry, dict):
            raise ValueError("entry is not an object")
        missing = [k for k in ("file", "format", "sha256") if k not in entry]
        if missing:
            return [f"{name}: manifest entry lacks {', '.join(missing)}"]
        if entry["format"] not in FORMATS:
            return [f"{name}: unknown format {entry['format']!r}"]
        if not os.path.exists(os.path.join(out_dir, entry["file"])):
            return [f"{name}: file missing"]
        return check_entry(entry, out_dir)
    except Exception as exc:  # noqa: BLE001 - a truncated file, a wrong key: report it and go on
        return [f"{name}: cannot check ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"]


def load_manifest(out_dir: str = GOLDEN_DIR) -> dict:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return {"version": 1, "entries": [], "notes": []}
    with open(path) as fh:
        return json.load(fh)


def save_manifest(manifest: dict, out_dir: str = GOLDEN_DIR) -> None:
    manifest["entries"].sort(key=lambda e: e["file"])
    with open(os.path.join(out_dir, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")


def check_entry(entry: dict, out_dir: str = GOLDEN_DIR) -> list[str]:
    """Problems with one stored entry: file integrity, then bit-exact reproduction."""
    tensors = load_file(os.path.join(out_dir, entry["file"]))
    x = tensors.pop("input")
    problems = [f"{entry['file']}: {name} sha256 differs from the manifest"
                for name, digest in entry["sha256"].items() if sha256(tensors[name]) != digest]
    q = FORMATS[entry["format"]].quantize(x)
    for name, stored in tensors.items():
        mine = q.buffers.get(name)
        if mine is None or mine.shape != stored.shape:
            problems.append(f"{entry['file']}: {name} shape {None if mine is None else tuple(mine.shape)}"
                            f" != stored {tuple(stored.shape)}")
            continue
        region = q.valid[name]
        differ = mine[region].contiguous().view(torch.uint8) != stored[region].contiguous().view(torch.uint8)
        if bool(differ.any()):
            problems.append(f"{entry['file']}: {name} differs in {int(differ.sum())} bytes of the valid region")
    return problems


def corpus_bytes(out_dir: str = GOLDEN_DIR) -> int:
    total = 0
    for root, _, files in os.walk(out_dir):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def main(argv: list[str] | None = None) -> int:
    args = golden_parser().parse_args(argv)
    if args.check:
        try:
            manifest = read_manifest(args.dir)
        except ManifestError as exc:
            print(f"qgather golden --check: {exc}", file=sys.stderr)
            return 1
        problems = [p for e in manifest["entries"] for p in check_entry_safely(e, args.dir)]
        for p in problems:
            print(p)
        print(f"golden: {len(manifest['entries'])} entries, {len(problems)} problems")
        return 1 if problems else 0
    if args.producer == "te" and not torch.cuda.is_available():
        print("qgather golden --producer te: needs a CUDA GPU with TransformerEngine", file=sys.stderr)
        return 4  # the usage-error exit status (README "Exit codes")
    notes = write(args.producer, args.dir)
    for note in notes:
        print(note)
    size = corpus_bytes(args.dir)
    print(f"golden: wrote {args.producer} entries; corpus {size / 1e6:.2f} MB (limit {MAX_CORPUS_BYTES / 1e6:.0f} MB)")
    return 0 if size <= MAX_CORPUS_BYTES else 1
