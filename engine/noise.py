"""Counter-based random numbers: every uniform a request draws is a function of ``(seed, step, position, stream,
column)`` (docs/design.md#decoding, "Randomness"), computed by an integer hash on the logits' device.

Why a hash and not a ``torch.Generator``: a generator's stream is consumed in call order, so a request's draws
would depend on how its rows were batched, and a CPU and a CUDA generator draw different streams. A keyed hash
gives the same draw to the same (request, step, position, column) alone or in any batch, on any device, and needs
no host round trip (the keys are host integers the request already knows; Philox in JAX/cuRAND is the same idea).

The hash is a lowbias32 variant from Chris Wellons' hash prospector (x ^= x >> 16; x *= 0x21f0aaad;
x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15) on 32-bit values held in int64 tensors: both multipliers are below
2**31, so a product of a 32-bit value stays below 2**63 and no int64 product overflows (signed overflow is
undefined in C++). The same code runs on Python ints (the row keys, on the host) and on tensors (the columns and
elements, on the device). A uniform has 32 bits of resolution: ``(h + 0.5) / 2**32``,
strictly inside (0, 1).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .transfer import to_device

__all__ = ["GUMBEL", "REMASK", "ACCEPT", "RESIDUAL", "DRAFT", "CHAIN", "Draws", "row_keys", "row_keys_of", "uniform"]

_M32 = 0xFFFFFFFF
# streams: draws of different purposes at the same (request, step, position) are independent
GUMBEL, REMASK, ACCEPT, RESIDUAL, DRAFT, CHAIN = range(6)


def _hash32(x):
    """The 32-bit hash of ``0 <= x < 2**32`` (int or int64 tensor; the module docstring)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def row_keys(seed: int, step: int, stream: int, positions: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 (CPU) keys of the rows predicting canvas ``positions`` at a request's ``step`` for ``stream``
    (one of the module's stream constants)."""
    pos = torch.as_tensor(positions, dtype=torch.long).cpu().reshape(-1)
    n = pos.numel()
    return row_keys_of(torch.full((n,), int(seed), dtype=torch.long), torch.full((n,), int(step), dtype=torch.long),
                       stream, pos)


def uniform(keys: torch.Tensor, width: int, device: torch.device | str) -> torch.Tensor:
    """``[N, width]`` float64 uniforms in (0, 1) on ``device``: column ``j`` of row ``i`` is a function of
    ``keys[i]`` and ``j`` only (keys from :func:`row_keys`, any device; moved to ``device``)."""
    k = to_device(keys.to(torch.long), device)[:, None]
    cols = _hash32(torch.arange(width, dtype=torch.long, device=device))[None, :]
    h = _hash32((k + cols) & _M32)
    return (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)


def row_keys_of(seeds: torch.Tensor, steps: torch.Tensor, stream: int, positions: torch.Tensor) -> torch.Tensor:
    """As :func:`row_keys` for rows of many requests at once: ``[N]`` int64 (CPU) ``seeds``, ``steps`` and
    ``positions`` per row (vectorized on the host: no Python loop over rows)."""
    h = _hash32(seeds & _M32)
    h = _hash32(h ^ ((seeds >> 32) & _M32))
    h = _hash32(h ^ (steps & _M32))
    h = _hash32(h ^ (stream & _M32))
    return _hash32(h ^ (positions & _M32))


class Draws:
    """The counter-based draws of one request's step: rows keyed by the canvas positions they predict.

    Args:
        seed: the choice's seed (``DecodingPlan.seed``). step: the request's step counter.
        positions: ``[N]`` canvas position of each row (a sequence or int64 tensor); ``None`` = the row index.
    """

    __slots__ = ("seed", "step", "positions")

    def __init__(self, seed: int, step: int, positions: Sequence[int] | torch.Tensor | None = None):
        self.seed, self.step = int(seed), int(step)
        if isinstance(positions, torch.Tensor) and positions.dtype == torch.long and positions.dim() == 1 \
                and positions.device.type == "cpu":
            self.positions = positions  # the usual case (a step's masked positions): no op
        else:
            self.positions = (None if positions is None
                              else torch.as_tensor(positions, dtype=torch.long).cpu().reshape(-1))

    def at(self, rows: Sequence[int] | torch.Tensor) -> "Draws":
        """The draws of a subset of the rows (``rows``: indices into them)."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu().reshape(-1)
        return Draws(self.seed, self.step, rows if self.positions is None else self.positions[rows])

    def keys(self, stream: int, n: int) -> torch.Tensor:
        """``[n]`` int64 (CPU) row keys for ``stream``."""
        pos = torch.arange(n, dtype=torch.long) if self.positions is None else self.positions[:n]
        return row_keys(self.seed, self.step, stream, pos)

    def uniform(self, stream: int, n: int, width: int, device: torch.device | str) -> torch.Tensor:
        """``[n, width]`` float64 uniforms of ``stream`` on ``device``."""
        return uniform(self.keys(stream, n), width, device)
