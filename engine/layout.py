"""The canvas layout of one request: pure arithmetic on lengths, no tensors (docs/design.md#decoding).

``prompt (P) | generation region (G masks) | suffix (S)``, with G = ``max_tokens`` rounded up to whole blocks (for
absolute alignment: up to the next multiple of ``block_size`` from position 0, so that the prompt's last partial
block is completed first), the last block cut short where the model's context ends. Positions past
``max_tokens`` are decoded but never returned. Blocks are decoded window by window (Fast-dLLM v2's sub-blocks; a
window is the whole block elsewhere); the step budget is split over the windows that hold generation positions.

The KV-budget fit (``unmask.engine.scheduler``) calls :func:`build_layout` to learn a request's canvas length
without building it. Errors: :class:`~unmask.engine.limits.ParamError` naming ``prompt`` or ``max_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .limits import ParamError


def split_steps(total_steps: int, num_blocks: int) -> list[int]:
    """LLaDA's step budget split over blocks: as even as possible, remainder to the earliest blocks, at least one
    step per block (no divisibility requirement). ``split_steps(10, 4) == [3, 3, 2, 2]``."""
    if num_blocks <= 0:
        return []
    total_steps = max(total_steps, num_blocks)
    base, rem = divmod(total_steps, num_blocks)
    return [base + (1 if i < rem else 0) for i in range(num_blocks)]


@dataclass(frozen=True)
class CanvasLayout:
    """Where everything sits on one request's canvas (canvas positions, ints).

    Attributes:
        prompt_len (P), gen_len (G), suffix_len (S), length = P + G + S; max_tokens: positions returned.
        origin: where block 0 starts (0 for absolute alignment, else P). block_size, window_size.
        blocks: ``[(start, end)]`` of every block holding generation positions (the first may start in the prompt).
        windows: ``[(block index, start, end)]`` decoding windows, generation positions only.
        window_steps: denoising steps of each window.
    """

    prompt_len: int
    gen_len: int
    suffix_len: int
    length: int
    max_tokens: int
    origin: int
    block_size: int
    window_size: int
    blocks: tuple[tuple[int, int], ...]
    windows: tuple[tuple[int, int, int], ...]
    window_steps: tuple[int, ...]


def build_layout(prompt_len: int, max_tokens: int, suffix_len: int, block_size: int, window_size: int,
                 absolute: bool, max_context: int, steps: int | None = None,
                 fixed_positions: frozenset[int] = frozenset()) -> CanvasLayout:
    """The layout of a request (:func:`layout_of`), computed once per distinct set of arguments: a layout is
    immutable and the same for every request of one shape (``generate`` with many prompts of one length, the
    KV-budget fit's bisection); arguments that cannot be hashed are laid out afresh. Raises as :func:`layout_of`
    (errors are not kept: every call raises its own)."""
    args = (prompt_len, max_tokens, suffix_len, block_size, window_size, absolute, max_context, steps,
            fixed_positions)
    try:
        return _cached_layout(*args)
    except TypeError:
        if all(_hashable(a) for a in args):
            raise  # the layout itself refused the arguments
        return layout_of(*args)


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def layout_of(prompt_len: int, max_tokens: int, suffix_len: int, block_size: int, window_size: int,
              absolute: bool, max_context: int, steps: int | None = None,
              fixed_positions: frozenset[int] = frozenset()) -> CanvasLayout:
    """The layout of a request.

    Args:
        prompt_len / max_tokens / suffix_len: lengths in tokens. block_size / window_size: block and window.
        absolute: blocks aligned to position 0 (else to the prompt's end). max_context: the model's context.
        steps: the request's total steps (split over the windows), ``None`` = one step per masked position of
            each window. fixed_positions: generated positions fixed by constraints (not masked).

    Raises:
        ParamError: (``prompt``) no room to generate; (``max_tokens``) the canvas exceeds the context;
            (``block_size``) a block longer than the context (docs/design.md#admission-and-limits). More
            ``steps`` than masked positions are not spent: a block never runs more steps than it has masks.
    """
    if block_size > max_context:
        raise ParamError("block_size", f"must be <= the model's context of {max_context} tokens, got {block_size}")
    P = prompt_len
    room = max_context - suffix_len   # canvas positions available before the suffix
    plus_suffix = f" + suffix ({suffix_len})" if suffix_len else ""
    if P >= room:
        raise ParamError("prompt", f"the prompt ({P} tokens{plus_suffix}) leaves no room to generate in the "
                                   f"model's context of {max_context} tokens")
    if P + max_tokens > room:
        raise ParamError("max_tokens", f"prompt ({P} tokens) + max_tokens ({max_tokens}){plus_suffix} = "
                                       f"{P + max_tokens + suffix_len} exceeds the model's context of "
                                       f"{max_context} tokens; at most {room - P} new tokens fit")
    bs = block_size
    origin = 0 if absolute else P
    # whole blocks, except that the last block is cut short at the context edge (a request that fits in the
    # context is never refused because of the rounding)
    gen_end = min(origin - (-(P + max_tokens - origin) // bs) * bs, room)  # integer ceil
    first_block_start = origin + ((P - origin) // bs) * bs
    blocks = tuple((s, min(s + bs, gen_end)) for s in range(first_block_start, gen_end, bs))
    windows = []
    for b, (s, e) in enumerate(blocks):
        for ws in range(s, e, window_size):
            lo, hi = max(ws, P), min(ws + window_size, e)
            if lo < hi:
                windows.append((b, lo, hi))
    # default steps = one per masked canvas position, window by window: max_tokens when it fills whole blocks
    # (docs/design.md#decisions), else max_tokens rounded up to the block; with ``max_tokens`` split evenly the
    # budget would be shared with the hidden positions of the last block (and a partial first block under
    # absolute alignment, or uneven sub-block windows, would get an even share), so some steps would reveal more
    # than one token
    if steps is None:
        window_steps = [max(1, (hi - lo) - sum(1 for p in fixed_positions if lo <= P + p < hi))
                        for _, lo, hi in windows]
    else:
        window_steps = split_steps(steps, len(windows))
    gen_len = gen_end - P
    return CanvasLayout(prompt_len=P, gen_len=gen_len, suffix_len=suffix_len, length=P + gen_len + suffix_len,
                        max_tokens=max_tokens, origin=origin, block_size=bs, window_size=window_size,
                        blocks=blocks, windows=tuple(windows), window_steps=tuple(window_steps))


#: :func:`build_layout`'s memo (argument types kept apart: a NumPy length lays out with its own type)
_cached_layout = lru_cache(maxsize=4096, typed=True)(layout_of)
