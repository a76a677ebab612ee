"""Where this package's Triton kernels can run (models/triton_*.py, rollout/triton_*.py).

    if triton_runs(x.device): ...   # CUDA with triton installed, or triton's CPU interpreter

Under TRITON_INTERPRET=1 (set before triton is imported: the tests' child processes) the kernels run on
CPU tensors; CPU-only installs without triton keep each caller's torch path.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:
    triton = None


def triton_runs(device: torch.device | str) -> bool:
    """Whether a Triton kernel can run on `device`: CUDA with triton, or triton's CPU interpreter."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
