"""Host-to-device copies of a step's small host-built tensors (indices, per-row values, the forward's inputs).

On a CUDA device the host tensor is pinned and copied with ``non_blocking=True``: the host goes on while the copy
runs, in stream order before the kernels that read it (PyTorch's caching host allocator keeps the pinned buffer
until the copy is done). Elsewhere it is a plain ``.to(device)`` (a no-op on the CPU).
"""
from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device``, without blocking the host on a CUDA device."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t
    if device.type == "cuda" and not t.is_pinned():
        try:
            t = t.pin_memory()
        except RuntimeError:  # no CUDA runtime to pin with (a CPU-only build faking the device in tests)
            pass
    return t.to(device, non_blocking=True)
