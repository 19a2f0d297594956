"""The resolved decoding plan of one request (docs/design.md sections 4 and 10)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodingPlan:
    """How one choice is decoded, every default resolved (read-only).

    Attributes:
        speculative: self-speculative decoding. block_size: block length (for speculative decoding: the draft
        block). draft_block: the draft block when speculative, else ``None``. temperature: resolved (0 = argmax).
        threshold: resolved threshold or ``None`` (quota decoding). seed: the choice's seed.
    """

    speculative: bool
    block_size: int
    draft_block: int | None
    temperature: float
    threshold: float | None
    seed: int
    top_k: int = 0
    top_p: float = 1.0
    steps: int | None = None
    remasking: str = "low_confidence"
    cache: str = "auto"
    cfg_scale: float = 0.0
