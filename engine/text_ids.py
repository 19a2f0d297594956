"""A request's token ids: text to ids with the mask token's text kept literal, and the checks on ids a request
carries (docs/design.md#http-contract, "Prompts and the mask token").

A tokenizer parses its added tokens out of any text, so a user who writes the mask token's text (``<|mask|>``,
``<|mdm_mask|>``) in a prompt or a message would put the mask id into the committed prompt: a position the engine
never decodes and, under the mask-row adapter (docs/design.md#mask-row-adapter), a row that runs the adapter's weights
and is outside the parent's vocabulary. Here such text becomes the ordinary tokens of its characters, as any other text;
token-id prompts that hold the mask id are refused by :func:`check_no_mask`. Options on a token the model never samples
(a ``logit_bias`` key, a ``stop_token_ids`` entry on the mask token, padding, a suppressed id) would have no effect and
are refused by :func:`check_sampleable` (docs/design.md#admission-and-limits).
"""
from __future__ import annotations

import operator

from typing import TYPE_CHECKING

from .limits import ParamError

if TYPE_CHECKING:
    from .config import DllmConfig
    from .params import SamplingParams


def _ids(tokenizer, text: str, add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens,
                          split_special_tokens=split_special_tokens).input_ids)


def encode_text(tokenizer, text: str, mask_token_id: int | None, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; wherever it spells the mask token, that text is tokenized as plain characters.

    Args:
        tokenizer: a Hugging Face tokenizer. text: the prompt, or a chat already rendered by its template.
        mask_token_id: the model's mask id (``DllmConfig.mask_token_id``); ``None`` = tokenize as is.
        add_special_tokens: wrap with the tokenizer's own special tokens (e.g. BOS), as ``tokenizer(text)`` does.

    Returns:
        ``list[int]`` without ``mask_token_id``. The common case (no mask text) is one tokenizer call; otherwise the
        text is split at the mask text, each piece tokenized alone and the mask text's characters
        (``split_special_tokens=True``) put between them, the special tokens wrapped around as the full call does.
    """
    ids = _ids(tokenizer, text, add_special_tokens)
    if mask_token_id is None or mask_token_id not in ids:
        return ids
    mask_text = tokenizer.convert_ids_to_tokens(mask_token_id)
    literal = _ids(tokenizer, mask_text, False, split_special_tokens=True)
    body: list[int] = []
    for i, piece in enumerate(text.split(mask_text)):
        body += (literal if i else []) + (_ids(tokenizer, piece, False) if piece else [])
    if not add_special_tokens:
        return body
    bare = _ids(tokenizer, text, False)  # the full call = its special tokens around these
    start = next(k for k in range(len(ids) - len(bare) + 1) if ids[k:k + len(bare)] == bare)
    return ids[:start] + body + ids[start + len(bare):]


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as plain characters: the texts of special tokens (``<|im_end|>``, the mask token) in it
    become the ordinary tokens of their characters (``split_special_tokens``), no special token is added. For a
    client's chat message inside a rendered template (``unmask.server.chat_prompt``)."""
    return _ids(tokenizer, text, False, split_special_tokens=True)


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    """Raise :class:`ParamError` naming ``name`` when an id is not in ``[0, vocab_size)`` (an id outside it would
    fail an index in the middle of a batched step and take the other requests of the batch down with it)."""
    if isinstance(ids, list) and all(type(t) is int for t in ids) and (not ids or 0 <= min(ids) <= max(ids) <
                                                                        vocab_size):
        return  # the usual list of plain ints, all in range (the loop below names the first bad one)
    for t in ids:
        try:
            ok = not isinstance(t, bool) and 0 <= operator.index(t) < vocab_size
        except TypeError:
            raise ParamError(name, f"token ids must be integers, got {t!r}") from None
        if not ok:
            raise ParamError(name, f"token id {t!r} is outside the vocabulary [0, {vocab_size})")


def check_no_mask(name: str, ids: list[int], mask_token_id: int) -> None:
    """Raise :class:`ParamError` naming ``name`` when token ids given as ids hold the mask id: a prompt or suffix
    is committed context, so a mask there is never decoded, and under the mask-row adapter its row would run the
    adapter (docs/design.md#http-contract, "Prompts and the mask token"; text spelling the mask token is tokenized as
    plain text by :func:`unmask.engine.text_ids.encode_text` instead)."""
    if mask_token_id in ids:
        raise ParamError(name, f"token id {mask_token_id} at position {ids.index(mask_token_id)} is the model's mask "
                               f"token, which a {name} cannot hold (it is never decoded there); positions to "
                               f"generate are the generation region's, or use suffix/constraints to infill")


def never_generated_reason(token_id: int, dllm: DllmConfig) -> str | None:
    """Why the model never samples ``token_id`` (it is in ``dllm.never_generate_ids``, whose logits are -inf before
    every draw: ``unmask.engine.sampler.forbid``), or ``None`` when it may be sampled."""
    if token_id not in dllm.never_generate_ids:
        return None
    if token_id == dllm.mask_token_id:
        return "the model's mask token"
    if token_id in dllm.suppress_token_ids:
        return "an id the checkpoint suppresses (dllm.suppress_token_ids)"
    return "the model's padding token (not an end-of-sequence token)"


def check_sampleable(name: str, ids, dllm: DllmConfig, effect: str, key: bool = False) -> None:
    """Raise :class:`ParamError` naming ``name`` when one of ``ids`` is never sampled (the mask token, padding,
    suppressed ids: :func:`never_generated_reason`): an option on such a token (a ``logit_bias`` key, a
    ``stop_token_ids`` entry) would be accepted and have no effect (docs/design.md#admission-and-limits). ``effect``:
    what the option would fail to do, for the message; ``key``: name the id as a quoted key (``logit_bias``)."""
    if not ids:
        return  # the usual case (no logit_bias, no stop_token_ids): nothing to look up
    never = set(dllm.never_generate_ids)
    bad = next((t for t in ids if t in never), None)
    if bad is not None:
        which = f'key "{bad}" (token id {bad})' if key else f"token id {bad}"
        raise ParamError(name, f"{which} is {never_generated_reason(bad, dllm)}, which is never sampled, so "
                               f"{effect}; drop it")


def suffix_ids(params: SamplingParams, tokenizer, mask_token_id: int | None = None) -> list[int]:
    """The suffix's token ids (infilling), ``[]`` without one; a text suffix spelling the mask token has it as
    plain text (:func:`~unmask.engine.text_ids.encode_text`)."""
    if params.suffix is None or params.suffix == "" or params.suffix == []:
        return []
    if isinstance(params.suffix, list):
        return list(params.suffix)
    return encode_text(tokenizer, params.suffix, mask_token_id, add_special_tokens=False)
