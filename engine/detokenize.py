"""Token ids -> text for outputs and streams: stop strings, UTF-8-safe prefixes, per-token display text."""
from __future__ import annotations

from functools import lru_cache

REPLACEMENT_CHAR = "\ufffd"


def decode(tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` with special tokens (EOS, mask) skipped and no clean-up of spaces.

    A list of ids on a Hugging Face fast tokenizer that overrides neither ``decode`` nor ``_decode`` goes straight
    to its ``backend_tokenizer`` (the ``tokenizers`` library), which is what ``decode`` calls there once it has
    converted the ids and found no clean-up to do: the same text without transformers' per-call conversion (the
    stop rules decode a choice's growing prefix every step it grows, issue 42)."""
    if not ids:
        return ""
    if type(ids) is list and _decodes_by_backend(tokenizer):
        return tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _decodes_by_backend(tokenizer) -> bool:
    """Whether ``tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`` of a list of
    ids is ``tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)``: a fast tokenizer whose class and
    instance keep transformers' own ``decode`` and ``_decode``."""
    attrs = getattr(tokenizer, "__dict__", None)
    return (attrs is not None and _plain_fast_class(type(tokenizer)) and "decode" not in attrs
            and "_decode" not in attrs)


@lru_cache(maxsize=None)
def _plain_fast_class(cls: type) -> bool:
    """``cls`` is a transformers fast tokenizer class with transformers' own ``decode`` and ``_decode``."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (issubclass(cls, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode)


def find_stop(text: str, stops: list[str], after: int = 0) -> tuple[int, str | None]:
    """Earliest occurrence of any stop string that ends after character ``after`` (``min_tokens``: vLLM checks
    no stop string before the output is that long): ``(index, stop)``, or ``(-1, None)``."""
    best, which = -1, None
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (best < 0 or i < best):
            best, which = i, s
    return best, which


def whole_chars(text: str) -> str:
    """``text`` without the trailing U+FFFD run that a multi-byte character cut by the end of the output (by
    ``max_tokens`` or the last block, not a stop string: text follows those characters; constrained decoding forces byte tokens too) decodes to: a
    final text never ends in a broken character, as the stream never shows one. (A model that truly writes U+FFFD
    as its last character loses it: the decoded text cannot tell the two apart.)"""
    end = len(text)
    while end > 0 and text[end - 1] == REPLACEMENT_CHAR:
        end -= 1
    return text[:end]


def stream_safe(text: str, stops: list[str]) -> str:
    """The part of a still-growing ``text`` that can be shown now.

    Holds back a trailing U+FFFD (a multi-byte character split across tokens) and the longest tail that is a
    prefix of a stop string (so that no stop-string prefix ever leaks into a stream).
    """
    text = whole_chars(text)
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]


class TokenTexts:
    """Cached display text of single tokens (for the denoising canvas and the revealed list)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._text = lru_cache(maxsize=65536)(self._one)

    def _one(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def __call__(self, token_id: int) -> str:
        return self._text(int(token_id))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` as the output's text is decoded (:func:`decode`: special tokens skipped)."""
        return decode(self._tokenizer, ids)
