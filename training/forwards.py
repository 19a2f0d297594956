"""The modules a training step calls (what accelerate/DDP wraps): the decoder forward with a training layout's mask and
the LM head on the scored outputs only (docs/design.md#training).

:class:`DiffusionForward` serves the diffusion objectives (``mdlm``, ``block``, ``trajectory``), :class:`DraftForward`
the ``draft`` objective; :func:`context_cache`, :func:`decoder_out` and :func:`scored_logits` are the pieces the
mask-row adapter's modules (``unmask.training.mask_adapter``) share with them.
"""
from __future__ import annotations

import inspect

import torch

from unmask.engine.kv_cache import BatchKV, LaneCache


def cache_kw(model) -> str:
    """Name of the decoder's external-cache argument (``cache`` in newer transformers, else ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model.get_decoder().forward).parameters else "past_key_values"


def context_cache(model, context_ids: torch.Tensor, context_mask: torch.Tensor) -> BatchKV:
    """``model`` forwards the clean context ``[B, L]`` causally without gradient; returns its keys/values as one
    committed lane per row (the verifier's context of a draft step, ``unmask.engine.routed``)."""
    B, L = context_ids.shape
    dev = context_ids.device
    ctx_pos = torch.arange(L, device=dev).expand(B, L)
    with torch.no_grad():
        ctx = BatchKV([LaneCache() for _ in range(B)], dev)
        model.get_decoder()(input_ids=context_ids, position_ids=ctx_pos, attention_mask=context_mask,
                            use_cache=False, **{cache_kw(model): ctx})
    layers = sorted(ctx.new_keys)
    lanes = [LaneCache.committed([ctx.new_keys[i][b] for i in layers], [ctx.new_values[i][b] for i in layers],
                                 ctx_pos[b], ctx_pos[b]) for b in range(B)]
    return BatchKV(lanes, dev)


def decoder_out(base, input_ids, position_ids, attention_mask, cache: BatchKV | None = None,
                hidden_states: bool = False):
    """``base``'s decoder over a training layout's rows (after the keys/values of ``cache`` when given)."""
    extra = {cache_kw(base): cache} if cache is not None else {}
    return base.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                              use_cache=False, output_hidden_states=hidden_states, **extra)


def scored_logits(base, out, src_row, src_col) -> torch.Tensor:
    """``[N, V]`` float32: the LM head on the decoder outputs at ``(src_row[i], src_col[i])`` only."""
    return base.get_output_embeddings()(out.last_hidden_state[src_row, src_col]).float()


class DiffusionForward(torch.nn.Module):
    """The diffusion objectives' module.

    ``forward(input_ids [B,T], position_ids [B,T], attention_mask [B,1,T,T] bool, src_row [N], src_col [N])
    -> [N, V]`` float32 logits; with ``hidden_layers`` (Repr-Align) ``(logits, [[N, H] per layer])``.
    """

    def __init__(self, tm):
        super().__init__()
        self.lm = tm.model
        self._tm = [tm]

    def forward(self, input_ids, position_ids, attention_mask, src_row, src_col, hidden_layers=()):
        base = self._tm[0].base
        out = decoder_out(base, input_ids, position_ids, attention_mask, hidden_states=bool(hidden_layers))
        logits = scored_logits(base, out, src_row, src_col)
        if hidden_layers:
            return logits, [out.hidden_states[layer][src_row, src_col] for layer in hidden_layers]
        return logits


class DraftForward(torch.nn.Module):
    """The ``draft`` objective's module: the frozen verifier forwards the clean context causally (no gradient) and
    the model forwards its draft groups against the verifier's keys/values - the verifier-routed speculative step of
    ``unmask.engine.routed``, in training.

    ``forward(context_ids [B,L], context_mask [B,1,L,L], input_ids [B,R], position_ids [B,R],
    attention_mask [B,1,R,L+R], src_row [N], src_col [N]) -> [N, V]`` float32 logits.
    """

    def __init__(self, tm, verifier):
        super().__init__()
        self.lm = tm.model
        self._tm = [tm]
        self._verifier = [verifier]  # a list: not a submodule (frozen, never in the optimizer or DDP)

    def forward(self, context_ids, context_mask, input_ids, position_ids, attention_mask, src_row, src_col):
        base = self._tm[0].base
        cache = context_cache(self._verifier[0], context_ids, context_mask)
        return scored_logits(base, decoder_out(base, input_ids, position_ids, attention_mask, cache), src_row, src_col)
