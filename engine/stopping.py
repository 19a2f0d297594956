"""Stop and EOS handling of one choice, in one place (docs/design.md#decisions).

A choice ends when the revealed left-to-right prefix of its generation region holds an EOS/stop id (every earlier
position revealed; the id is counted, never rendered), when its text contains a stop string (cut before it,
the output keeping the fewest tokens whose text contains it), when ``max_tokens`` are revealed, or when its last
block is done. Under ``min_tokens`` no stop string counts before the output has that many tokens. The stream
shows only the stream-safe text (``unmask.engine.detokenize.stream_safe``), which only grows; the final text never
ends in a broken multi-byte character (``whole_chars``).
"""
from __future__ import annotations

from .detokenize import decode, find_stop, stream_safe, whole_chars


class StopChecker:
    """The finish rules over a growing revealed prefix.

    Args:
        tokenizer: for the text. stop: stop strings. min_tokens: see the module docstring.
        eos_ids: ids that end the output (EOS unless ``ignore_eos``, plus ``stop_token_ids``).
        max_tokens: the most tokens returned.

    Attributes:
        prefix: the revealed left-to-right prefix (token ids; up to and including an EOS id).
        stream_text: the stream-safe text so far.
        checked: :meth:`update` has run once (from then on an update without new ids and not at the end does
            nothing).
    """

    def __init__(self, tokenizer, stop: list[str], min_tokens: int, eos_ids: set[int], max_tokens: int):
        self.tokenizer = tokenizer
        self.stops = list(stop)
        self.min_tokens = min_tokens
        self.eos_ids = eos_ids
        self.max_tokens = max_tokens
        self.prefix: list[int] = []
        self.stream_text = ""
        self.checked = False

    def update(self, new_ids: list[int], at_end: bool) -> tuple[str, list[int], str] | None:
        """Extend the prefix by ``new_ids`` (the newly revealed contiguous tokens after it; ``at_end``: no block
        is left to decode) and apply the rules: ``(finish_reason, output ids, text)`` when the choice ends, else
        ``None`` (``stream_text`` may have grown)."""
        if not new_ids and self.checked and not at_end:
            return None  # the prefix did not grow: skip the re-decode (most steps of a block not decoded in order)
        self.checked = True
        prefix = self.prefix
        eos_hit = False
        for t in new_ids:
            prefix.append(t)
            if t in self.eos_ids:
                eos_hit = True
                break
        complete = eos_hit or len(prefix) == self.max_tokens or at_end
        text_ids = prefix[:-1] if eos_hit else prefix
        text = decode(self.tokenizer, text_ids)
        stops, min_tok = self.stops, self.min_tokens
        after = len(decode(self.tokenizer, text_ids[:min_tok])) if min_tok and stops else 0
        checkable = bool(stops) and len(text_ids) >= min_tok
        idx, which = find_stop(text, stops, after) if checkable else (-1, None)
        if idx >= 0:
            n = len(text_ids)  # fewest tokens whose text contains the stop string
            for k in range(max(1, min_tok), len(text_ids) + 1):
                if find_stop(decode(self.tokenizer, text_ids[:k]), [which], after)[0] >= 0:
                    n = k
                    break
            return "stop", text_ids[:n], text[:idx]  # text follows: a U+FFFD before a stop string is no cut character
        if complete:  # the ids stay (they were generated and count); the text holds no broken character
            return ("stop" if eos_hit else "length"), list(prefix), whole_chars(text)
        safe = stream_safe(text, stops)
        if len(safe) > len(self.stream_text) and safe.startswith(self.stream_text):
            self.stream_text = safe
        return None
