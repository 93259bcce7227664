"""Fixtures of the GPU tests (`-m gpu`; skipped without a CUDA GPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")
