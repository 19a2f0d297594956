"""The KV pool's size (docs/design.md#admission-and-limits): blocks from a token budget on a CPU, from the free
memory a GPU reports on a GPU.

* CPU: ``--max-cached-tokens`` (canvas tokens over the running batch; None = the pool grows as needed) rounded up to
  blocks, plus one block per lane the batch can hold (a lane's last block is partly used): every batch the token
  budget admits then has its blocks.
* GPU: ``torch.cuda.mem_get_info`` after the model is loaded; the pool may take what keeps the device's use under
  ``--gpu-memory-utilization`` of its total (vLLM's option of that name: ``free - (1 - fraction) x total``; the
  rest covers the step's working memory), in whole blocks. A token budget given too lowers it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["token_blocks", "gpu_blocks", "pool_blocks"]


def token_blocks(tokens: int, block_tokens: int, lanes: int) -> int:
    """Blocks for a budget of ``tokens`` canvas tokens over at most ``lanes`` lanes."""
    return -(-int(tokens) // block_tokens) + int(lanes)


def gpu_blocks(device: torch.device, block_bytes: int, fraction: float, reserve_bytes: int = 0,
               mem_get_info: Callable | None = None) -> int:
    """Blocks of ``block_bytes`` that fit in what ``device`` has free beyond ``(1 - fraction)`` of its total and
    ``reserve_bytes`` (the step's working memory): ``(free - (1 - fraction) x total - reserve_bytes) // block_bytes``,
    at least 0.

    Raises:
        ValueError: ``fraction`` outside ``(0, 1]`` or ``block_bytes`` < 1.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {fraction}")
    if block_bytes < 1:
        raise ValueError(f"block_bytes: must be >= 1, got {block_bytes}")
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    usable = int(free - (1.0 - fraction) * total) - int(reserve_bytes)
    return max(0, usable // int(block_bytes))


def pool_blocks(device: torch.device, max_cached_tokens: int | None, block_tokens: int, bytes_per_token: int | None,
                lanes: int, fraction: float) -> int | None:
    """The pool's capacity in blocks on ``device`` (None: unbounded, a CPU without a token budget)."""
    by_tokens = token_blocks(max_cached_tokens, block_tokens, lanes) if max_cached_tokens is not None else None
    if torch.device(device).type != "cuda" or not bytes_per_token:
        return by_tokens
    by_bytes = gpu_blocks(torch.device(device), bytes_per_token * block_tokens, fraction)
    return by_bytes if by_tokens is None else min(by_tokens, by_bytes)
