"""Text to token ids with the mask token's text kept literal (docs/design.md section 5, "Prompts and the mask
token").

A tokenizer parses its added tokens out of any text, so a user who writes the mask token's text (``<|mask|>``,
``<|mdm_mask|>``) in a prompt or a message would put the mask id into the committed prompt: a position the engine
never decodes and, under the mask-row adapter (section 21), a row that runs the adapter's weights and is outside
the parent's vocabulary. Here such text becomes the ordinary tokens of its characters, as any other text; token-id
prompts that hold the mask id are refused by :func:`unmask.engine.request.check_no_mask`.
"""
from __future__ import annotations


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
