"""A loaded model's first forward, run once before a server accepts requests (docs/design.md#devices).

A model that cannot run on its device (weights on two devices, an adapter left on the CPU, a dtype the device
lacks) would otherwise fail every request while ``/health`` says ok. The check forwards a few committed rows and a
few mask rows (the row variant's rows, where the model has one) through :meth:`LoadedModel.hidden_states` and
:meth:`LoadedModel.logits` exactly as a decoding step does.
"""
from __future__ import annotations

import torch

from .attention import build_attention_mask, canvas_groups
from .config import OWN_FORWARD_FAMILIES
from .model import LoadedModel

__all__ = ["SelfCheckError", "check_first_forward"]


class SelfCheckError(RuntimeError):
    """The model's first forward failed or gave non-finite logits (one line: device, dtype, the cause)."""


def check_first_forward(model: LoadedModel, committed: int = 3, masked: int = 2) -> None:
    """Forward ``committed`` prompt rows then ``masked`` mask rows (one mask group) in one batch row.

    Raises:
        SelfCheckError: the forward raised, or a logit is NaN/inf.
    """
    dev = model.device
    n = committed + masked
    ids = torch.tensor([[model.dllm.pad_token_id or 0] * committed + [model.dllm.mask_token_id] * masked],
                       dtype=torch.long, device=dev)
    pos = torch.arange(n, device=dev)[None]
    grp, start, is_committed = (t[None] for t in canvas_groups(n, model.dllm.attention, committed, committed, n,
                                                                 max(masked, 1), committed, device=dev))
    valid = torch.ones_like(is_committed)
    variant = ~is_committed if model.has_row_variant else None
    what = f"the model's first forward on {dev} ({str(model.dtype).removeprefix('torch.')}, weights " \
           f"{model.weight_format})"
    try:
        with torch.inference_mode():
            if model.dllm.family in OWN_FORWARD_FAMILIES:
                logits = _encoder_decoder_logits(model, ids[:, :committed])
            else:
                mask = build_attention_mask(pos, grp, start, valid, pos, grp, is_committed, valid)
                hidden = model.hidden_states(ids, pos, mask, variant_rows=variant)
                logits = model.logits(hidden[0], variant_rows=None if variant is None else variant[0])
        finite = bool(torch.isfinite(logits).all())
    except Exception as exc:  # any failure here would be every request's
        raise SelfCheckError(f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                             ) from exc
    if not finite:
        raise SelfCheckError(f"{what} gave non-finite logits")


def _encoder_decoder_logits(model: LoadedModel, prompt: torch.Tensor) -> torch.Tensor:
    """An encoder-decoder family's first forward (``unmask.engine.uniform_canvas``): the encoder over ``prompt``
    ``[1, P]`` into a fresh cache, then the decoder over one canvas of zeros; its ``[1, C, V]`` logits."""
    from transformers import DynamicCache

    net = model.model
    cache = DynamicCache(config=net.config.get_text_config(decoder=True))
    net.model.encoder(input_ids=prompt, cache=cache)
    canvas = torch.zeros((1, model.dllm.block_size), dtype=torch.long, device=prompt.device)
    return net(decoder_input_ids=canvas, cache=cache).logits
