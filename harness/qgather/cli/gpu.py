"""`qgather gpu-check`: what the GPU job will use (devices, backends, optional libraries); exit 1
without a GPU."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Print the GPUs, the backends per world size and the optional libraries' versions."""
    argparse.ArgumentParser(prog="qgather gpu-check", description=main.__doc__ + " Exit 1 without a GPU.").parse_args(
        list(argv))
    import torch  # once the arguments are read: --help and a bad option answer without loading it

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("qgather gpu-check: no GPU found (torch.cuda.is_available() is False); "
              "run `make test` for the CPU suite", file=sys.stderr)
        return 1
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
    print(f"gpus: {count} x {', '.join(names)} (sm {capability}); torch {torch.__version__}")
    print(f"backends: nccl for world sizes <= {count} (one rank per GPU), gloo on CUDA tensors above")
    for module in ("transformer_engine", "torchao"):
        try:  # optional libraries: whatever their import raises is one line of the report
            version = getattr(importlib.import_module(module), "__version__", "?")
            print(f"{module}: {version}")
        except Exception as exc:  # noqa: BLE001 - report any import failure as one line
            print(f"{module}: not available ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    return 0
