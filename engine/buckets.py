"""The size ladders of the static post-forward step (docs/design.md#decoding, "Static shapes and CUDA graphs").

A CUDA graph replays fixed shapes, so a step's sizes are padded up to the next rung of a short ladder (the idea of
vLLM's capture sizes): the rows of the batched reveal pass (every sequence's masked positions: batch x block), the
segments (one per window or active block: about the batch) and the segment width (the block). Powers of two with
1.5x steps in between for rows keep a padded step within 1.5x the rows it needs (above 8 rows) while a server sees
at most 21 row shapes; segments and widths are small and take powers of two.
"""
from __future__ import annotations

__all__ = ["ROW_BUCKETS", "SEGMENT_BUCKETS", "WIDTH_BUCKETS", "bucket"]

#: rows of a step's reveal pass (batch x masked positions per sequence)
ROW_BUCKETS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
#: segments (windows / active blocks) of a step
SEGMENT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: the widest segment of a step (a window's masked rows: at most the block size)
WIDTH_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)


def bucket(n: int, ladder: tuple[int, ...]) -> int | None:
    """The smallest rung of ``ladder`` (ascending) that is >= ``n`` (``n`` >= 0), or ``None`` past its top."""
    for size in ladder:
        if size >= n:
            return size
    return None
