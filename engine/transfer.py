"""Host-to-device copies of a step's small host-built tensors (indices, per-row values, the forward's inputs).

On a CUDA device the host tensor is pinned and copied with ``non_blocking=True``: the host goes on while the copy
runs, in stream order before the kernels that read it (PyTorch's caching host allocator keeps the pinned buffer
until the copy is done). Elsewhere it is a plain ``.to(device)`` (a no-op on the CPU).
"""
from __future__ import annotations

import torch

__all__ = ["copy_into", "to_device"]


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in pinned host memory when it goes to a CUDA ``device`` (as it is where it cannot be pinned)."""
    if device.type == "cuda" and not t.is_pinned():
        try:
            t = t.pin_memory()
        except RuntimeError:  # no CUDA runtime to pin with (a CPU-only build faking the device in tests)
            pass
    return t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device``, without blocking the host on a CUDA device."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t
    return _pinned(t, device).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy host ``src`` into ``dst`` (same shape, any device; a CUDA graph's static input) without blocking the
    host on a CUDA device; returns ``dst``."""
    return dst.copy_(_pinned(src, dst.device), non_blocking=True)
