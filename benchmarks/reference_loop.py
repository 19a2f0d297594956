"""The frozen reference loop of issue 42: a plain PyTorch batch decoder the Fast-dLLM way, against which the
engine's speed is measured (``benchmarks/bench_vs_reference.py``). FROZEN: never changed to make the engine look
better; a change that makes it slower is not allowed, one that makes it faster is welcome. First committed in
fb73c27 (cache none), the prefix cache added in 1338c97, the LM head on the masked rows only (was: the whole
block) since 83b3ddf; its "before" figures: docs/results.md, issue 42.

What it is (everything vectorized over the batch ``[B, ...]``; no per-lane Python):

* **Weights and forward.** The same :class:`unmask.engine.model.LoadedModel` the engine serves (its transformers
  module as loaded by ``load_model``; the benchmarks use ``weights="native"`` float32 on the CPU): one
  ``LoadedModel.hidden_states(input_ids [B, T], position_ids [B, T], mask [B, 1, T, T] bool)`` per step over every
  unfinished lane, no KV cache (cache policy ``none``; the prefix cache below is the other policy), then
  ``LoadedModel.logits`` on the rows that predict the active blocks' masked positions (``[B * M, H] -> [B * M,
  V]`` float32, ``M`` the most masks left in a lane's block; a lane with fewer pads with revealed positions, whose
  confidence is ``-inf``; through the logit shift, the row before each position, when the family has one).
* **Forwarded rows and mask.** ``prefix_causal`` (A2D): rows ``[0, T)`` with ``T`` the largest block end ``e`` over the
  unfinished lanes; a lane with active block ``[a, e)`` lets row ``q < e`` see key ``k`` iff ``k <= q`` or
  (``q >= a`` and ``k < e``): committed tokens strictly causal, the active block bidirectional over everything before
  its end (the rule of ``engine/attention.py`` for ``prefix_causal``, written out); a row ``q >= e`` sees itself only
  (its output is never read). ``bidirectional`` (LLaDA): the whole canvas ``[0, L)`` with an all-True mask.
  Position ids are canvas positions ``0 .. T - 1``.
* **Layout.** Prompts of one length ``P`` (Fast-dLLM's ``generate`` takes a ``[B, P]`` tensor); canvas
  ``prompt | ceil(max_tokens / block_size) * block_size masks`` (generation-aligned blocks, no suffix); blocks left
  to right, each lane at its own block.
* **Candidates.** The never-generated ids (``dllm.never_generate_ids``: mask, pad) get ``-inf``; greedy candidate
  ``x0 = argmax`` over the vocabulary; confidence ``p(x0) = exp(max - lse)``, ``lse = log(sum_v exp(l_v - max)) +
  max`` in float64 (the exponentials in float32, their sum and log in float64; Fast-dLLM takes a float64 softmax,
  float32 gives ties); LLaDA's ``low_confidence`` remasking; positions already revealed get confidence ``-inf``.
* **Reveal rule.** Quota: ``k = ceil(m / r)`` of the most confident masked positions of the lane's block (``m`` masks
  left in it, ``r`` its steps left, ``k = m`` at the last step), the block's steps being ``steps`` split over the
  blocks as LLaDA does (as even as possible, remainder to the earliest blocks, at least one each) or ``block_size``
  per block when ``steps`` is None. Threshold (Fast-dLLM, arXiv:2505.22618): every masked position with
  ``p(x0) >= threshold`` plus the most confident one. A lane moves to its next block when its block has no mask left;
  a lane with every block full leaves the batch.
* **Host syncs.** One read per step: the lanes' block indices and masks left to the host (which lanes are
  unfinished, how many rows to forward, ``M``), and the unfinished lanes' indices copied back
  (``torch.tensor(..., device=)``).
* **Prefix cache** (``cache="prefix"``, bidirectional models without the logit shift; Fast-dLLM v1's
  ``generate_with_prefix_cache``): the batch goes block by block together; a block's first step forwards the whole
  canvas ``[B, L]`` (all-True mask) into a transformers ``DynamicCache``, which is cut back to the prefix ``[0, a)``;
  the block's later steps forward rows ``[a, L)`` (mask ``[B, 1, L - a, L]`` all True) over the cached prefix, the
  cache cut back to ``a`` after each. A lane whose block is full waits (forwarded, nothing revealed: its tokens are
  those of decoding alone) until every lane's is; one host sync per step (the most masks left in a lane's block).

Greedy only (temperature 0), no EOS stop (every lane decodes ``max_tokens`` tokens: the engine side runs with
``ignore_eos``), no CFG, no sub-blocks. Checked token for token against the engine (before issue 42) on tiny
prefix-causal and bidirectional models, batch 1/8/32, quota and threshold, both caches (``bench_vs_reference.py``
asserts it on every run).

    tokens = reference_generate(model, prompts, ReferenceConfig(max_tokens=32, block_size=8, steps=16))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTIONS = ("prefix_causal", "bidirectional")
CACHES = ("none", "prefix")


@dataclass(frozen=True)
class ReferenceConfig:
    """Settings of :func:`reference_generate`: ``max_tokens`` per lane, ``block_size``, total ``steps`` (None = one
    per position), ``threshold`` (None = quota decoding) and ``cache`` (``none`` | ``prefix``)."""

    max_tokens: int
    block_size: int
    steps: int | None = None
    threshold: float | None = None
    cache: str = "none"


def block_steps(steps: int | None, num_blocks: int, block_size: int) -> list[int]:
    """Steps of each block: ``steps`` split as evenly as possible, the remainder to the earliest blocks, at least one
    per block (LLaDA); ``block_size`` each when ``steps`` is None."""
    if steps is None:
        return [block_size] * num_blocks
    total = max(steps, num_blocks)
    base, rem = divmod(total, num_blocks)
    return [base + (1 if i < rem else 0) for i in range(num_blocks)]


def _attention_mask(a: torch.Tensor, e: torch.Tensor, T: int, attention: str) -> torch.Tensor:
    """``[B, 1, T, T]`` bool (True = may attend) for lanes whose active blocks are ``[a, e)`` (``[B]`` int64)."""
    B = a.shape[0]
    if attention == "bidirectional":
        return torch.ones(B, 1, T, T, dtype=torch.bool, device=a.device)
    q = torch.arange(T, device=a.device)[None, :, None]
    k = torch.arange(T, device=a.device)[None, None, :]
    a_, e_ = a[:, None, None], e[:, None, None]
    allowed = torch.where(q < e_, (k <= q) | ((q >= a_) & (k < e_)), k == q)
    return allowed[:, None]


def _reveal(conf: torch.Tensor, masked: torch.Tensor, steps_left: torch.Tensor, threshold: float | None
            ) -> torch.Tensor:
    """``[B, W]`` bool: the window positions revealed this step (``conf``: ``[B, W]`` float64, ``-inf`` where not
    masked; ``masked``: ``[B, W]`` bool; ``steps_left``: ``[B]`` int64)."""
    if threshold is not None:
        chosen = masked & (conf >= threshold)
        best = conf.argmax(dim=1, keepdim=True)
        return chosen.scatter(1, best, True) & masked
    m = masked.sum(dim=1)
    quota = torch.where(steps_left <= 1, m, torch.div(m + steps_left - 1, steps_left.clamp_min(1),
                                                      rounding_mode="floor"))
    order = conf.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(conf.shape[1], device=conf.device)
                                            .expand_as(order).contiguous())
    return masked & (rank < quota[:, None])


def _decide(model, h: torch.Tensor, win: torch.Tensor, steps_left: torch.Tensor, forbidden: torch.Tensor,
            threshold: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's candidates and reveals for ``n`` lanes: ``h`` ``[n, W, H]`` hidden states of the window's output
    rows, ``win`` ``[n, W]`` the window's tokens, ``steps_left`` ``[n]``. Returns the window's new tokens ``[n, W]``
    and the masks left in it ``[n]``."""
    n, W, H = h.shape
    logits = model.logits(h.reshape(n * W, H)).view(n, W, -1)
    logits[..., forbidden] = float("-inf")
    top, x0 = logits.max(dim=-1)
    masked = win == model.dllm.mask_token_id
    # log p(x0) = max - logsumexp: the exponentials in float32, their sum and the log in float64
    lse = torch.exp(logits - top[..., None]).sum(dim=-1, dtype=torch.float64).log() + top.double()
    conf = torch.where(masked, torch.exp(top.double() - lse),
                       torch.full(top.shape, float("-inf"), dtype=torch.float64, device=h.device))
    chosen = _reveal(conf, masked, steps_left, threshold)
    return torch.where(chosen, x0, win), (masked & ~chosen).sum(dim=1)


@torch.no_grad()
def reference_generate(model, prompts: torch.Tensor, cfg: ReferenceConfig) -> torch.Tensor:
    """Decode ``prompts`` (``[B, P]`` int64, one prompt length) with ``model`` (a ``LoadedModel``) by the rule of the
    module docstring. Returns ``[B, max_tokens]`` int64 generated tokens (on the model's device).

    Raises:
        ValueError: an attention mode, block alignment or cache it does not implement, or a canvas past the context.
    """
    dllm = model.dllm
    if dllm.attention not in ATTENTIONS:
        raise ValueError(f"attention: the reference implements {ATTENTIONS}, not {dllm.attention!r}")
    if dllm.block_alignment != "generation":
        raise ValueError(f"block_alignment: the reference aligns blocks to the generation, not "
                         f"{dllm.block_alignment!r}")
    if cfg.cache not in CACHES:
        raise ValueError(f"cache: the reference implements {CACHES}, not {cfg.cache!r}")
    if cfg.cache == "prefix" and (dllm.attention != "bidirectional" or dllm.logit_shift):
        raise ValueError("cache: the reference's prefix cache is for bidirectional models without the logit shift")
    dev = model.device
    prompts = prompts.to(dev)
    B, P = prompts.shape
    num_blocks = -(-cfg.max_tokens // cfg.block_size)
    L = P + num_blocks * cfg.block_size
    if L > model.max_context:
        raise ValueError(f"max_tokens: canvas of {L} positions exceeds the model's context of {model.max_context}")
    canvas = torch.full((B, L), dllm.mask_token_id, dtype=torch.long, device=dev)
    canvas[:, :P] = prompts
    budget = torch.tensor(block_steps(cfg.steps, num_blocks, cfg.block_size), dtype=torch.long, device=dev)
    forbidden = torch.tensor(dllm.never_generate_ids, dtype=torch.long, device=dev)
    decode = _decode_prefix_cache if cfg.cache == "prefix" else _decode_no_cache
    decode(model, canvas, P, num_blocks, budget, forbidden, cfg)
    return canvas[:, P:P + cfg.max_tokens]


def _masked_first(win: torch.Tensor, mask_id: int, width: int) -> torch.Tensor:
    """``[n, width]`` indices into the window ``win`` (``[n, W]``): its masked positions first, in ascending order,
    then the others (``width`` >= every lane's mask count: the rows whose logits the step needs)."""
    return (win != mask_id).to(torch.int8).argsort(dim=1, stable=True)[:, :width]


def _decode_no_cache(model, canvas: torch.Tensor, P: int, num_blocks: int, budget: torch.Tensor,
                     forbidden: torch.Tensor, cfg: ReferenceConfig) -> None:
    """Cache ``none``: every lane at its own block, the unfinished lanes forwarded each step (``canvas`` ``[B, L]``
    filled in place)."""
    dllm, dev = model.dllm, canvas.device
    B, L = canvas.shape
    bs = cfg.block_size
    shift = 1 if dllm.logit_shift else 0
    block = torch.zeros(B, dtype=torch.long, device=dev)
    step_in_block = torch.zeros(B, dtype=torch.long, device=dev)
    offs = torch.arange(bs, device=dev)
    positions = torch.arange(L, device=dev)
    while True:
        # the step's one host sync: each lane's block and masks left in it
        start = P + block.clamp(max=num_blocks - 1) * bs
        masks_left = (canvas.gather(1, start[:, None] + offs) == dllm.mask_token_id).sum(dim=1)
        blocks_now, masks_now = torch.stack([block, masks_left]).tolist()
        live_list = [i for i, b in enumerate(blocks_now) if b < num_blocks]
        if not live_list:
            break
        T = L if dllm.attention == "bidirectional" else P + (max(blocks_now[i] for i in live_list) + 1) * bs
        width = max(masks_now[i] for i in live_list)
        live = torch.tensor(live_list, dtype=torch.long, device=dev)
        blk = block[live]
        a = P + blk * bs
        x = canvas[live]
        n = x.shape[0]
        hidden = model.hidden_states(x[:, :T], positions[:T].expand(n, T), _attention_mask(a, a + bs, T,
                                                                                           dllm.attention))
        win_pos = a[:, None] + offs
        sel_pos = win_pos.gather(1, _masked_first(x.gather(1, win_pos), dllm.mask_token_id, width))
        h = hidden.gather(1, (sel_pos - shift)[..., None].expand(n, width, hidden.shape[-1]))
        new_sel, left = _decide(model, h, x.gather(1, sel_pos), budget[blk] - step_in_block[live], forbidden,
                                cfg.threshold)
        canvas[live] = x.scatter(1, sel_pos, new_sel)
        filled = left == 0
        block[live] = blk + filled.long()
        step_in_block[live] = torch.where(filled, torch.zeros_like(blk), step_in_block[live] + 1)


def _decode_prefix_cache(model, canvas: torch.Tensor, P: int, num_blocks: int, budget: torch.Tensor,
                         forbidden: torch.Tensor, cfg: ReferenceConfig) -> None:
    """Fast-dLLM's prefix cache (bidirectional models): the batch goes block by block together; a block's first step
    forwards the whole canvas into a transformers ``DynamicCache`` cut back to the prefix ``[0, a)``, its later steps
    forward ``[a, L)`` over the cached prefix (the cache cut back to ``a`` after each). A lane whose block is full
    waits (forwarded, nothing revealed) until every lane's is."""
    from transformers import DynamicCache

    dev = canvas.device
    B, L = canvas.shape
    bs = cfg.block_size
    mask_id = model.dllm.mask_token_id
    positions = torch.arange(L, device=dev)
    for blk in range(num_blocks):
        a, e = P + blk * bs, P + (blk + 1) * bs
        step_in_block = torch.zeros(B, dtype=torch.long, device=dev)
        cache = None
        while True:
            masks_left = (canvas[:, a:e] == mask_id).sum(dim=1)
            width = int(masks_left.max())  # the step's one host sync
            if width == 0:
                break
            if cache is None:  # refresh
                cache = DynamicCache(config=model.model.config)
                hidden = model.hidden_states(canvas, positions.expand(B, L),
                                             torch.ones(B, 1, L, L, dtype=torch.bool, device=dev), cache=cache)
                offset = a
            else:
                hidden = model.hidden_states(canvas[:, a:], positions[a:].expand(B, L - a),
                                             torch.ones(B, 1, L - a, L, dtype=torch.bool, device=dev), cache=cache)
                offset = 0
            cache.crop(a - cache.get_seq_length())  # back to the prefix (a negative count of tokens to drop)
            win = canvas[:, a:e]
            sel = _masked_first(win, mask_id, width)
            h = hidden.gather(1, (sel + offset)[..., None].expand(B, width, hidden.shape[-1]))
            new_sel, _ = _decide(model, h, win.gather(1, sel), budget[blk] - step_in_block, forbidden,
                                 cfg.threshold)
            step_in_block += (masks_left > 0).long()
            canvas[:, a:e] = win.scatter(1, sel, new_sel)
