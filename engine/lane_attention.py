"""Attention over each lane's own keys, without copying caches (docs/design.md#decoding, "KV cache"): the
transformers attention function of the engine's models (``unmask_lanes``, registered here).

transformers' attention reads the keys its cache's ``update`` returns; a batched cache must return one ``[B, H, C +
Q, D]`` tensor, so every lane's cached keys were copied into a padded tensor on every layer of every step (for an
8B model, 16 lanes of 2k tokens: ~16 GiB per step). Inside :func:`lanes` the engine's
:class:`~unmask.engine.kv_cache.BatchKV` instead writes each lane's new keys after its cached ones in the lane's own
buffer (its scratch tail) and returns only the new keys; this function then runs one SDPA call per lane on a view of
the lane's buffer: its ``n_b`` cached keys and its ``Q_b`` chunk rows. Bytes moved per step: the new rows' keys.

Per lane: grouped-query attention without repeating K/V (``enable_gqa``); no mask at all when every row of the
lane sees every key (:attr:`BatchKV.sees_all`, decided on the host: a decoding step of the exact cache whose rows are
one group), else the lane's slice of the engine's boolean mask. Outside :func:`lanes` (training, a bare forward)
it is transformers' SDPA attention, unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["NAME", "lanes", "register", "use_lanes"]

NAME = "unmask_lanes"
_current: contextvars.ContextVar = contextvars.ContextVar("unmask_lane_cache", default=None)


@contextlib.contextmanager
def lanes(cache) -> Iterator[None]:
    """Inside: the attention of the engine's models reads each lane's keys from ``cache`` (a
    :class:`~unmask.engine.kv_cache.BatchKV` in lane mode)."""
    token = _current.set(cache)
    try:
        yield
    finally:
        _current.reset(token)


def lane_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[B, Hq, Q, D]``; ``key``/``value`` the new chunk's
    ``[B, Hkv, Q, D]`` (lane mode) or every key (otherwise); returns ``([B, Q, Hq, D], None)``."""
    cache = _current.get()
    if cache is None or not getattr(cache, "lane_mode", False):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, Hq, Q, D = query.shape
    gqa = key.shape[1] != Hq
    out = query.new_zeros(B, Q, Hq, D)
    C = cache.cached_len
    for b in range(B):
        q_b = cache.rows[b]  # the lane's real chunk rows (the rest is padding)
        if q_b == 0:
            continue
        k_b, v_b, n_b = cache.lane_keys(b, module.layer_idx, key, value)
        mask = None
        if not cache.sees_all[b] and attention_mask is not None:
            mask = cache.lane_mask(b, attention_mask, n_b, q_b, C)
        o = F.scaled_dot_product_attention(query[b:b + 1, :, :q_b], k_b[None], v_b[None], attn_mask=mask,
                                           scale=scaling, enable_gqa=gqa)
        out[b, :q_b] = o[0].transpose(0, 1)
    return out, None


def use_lanes(loaded) -> None:
    """Switch ``loaded`` (a :class:`~unmask.engine.loaded.LoadedModel`) to :func:`lane_attention` when its decoder
    runs the transformers forward (a fused decoder has its own attention) and every attention module reads
    ``config._attn_implementation`` (transformers' models do); the engine's caches then run in lane mode."""
    if loaded.decoder_forward is not None:
        return
    register()
    set_impl = getattr(loaded.model, "set_attn_implementation", None)
    try:
        if set_impl is not None:
            set_impl(NAME)
        else:  # pragma: no cover - older transformers
            loaded.model.config._attn_implementation = NAME
    except (ValueError, TypeError, AttributeError):  # a model class that refuses custom attention: keep SDPA
        return
    loaded.lane_attention = True


def register() -> None:
    """Register :func:`lane_attention` (and the SDPA mask format for it) with transformers, once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, lane_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
