"""Which revealed tokens a streamed choice's text carries, so that each chunk carries the logprobs of the tokens whose
text it first shows (docs/design.md#http-contract, "Streaming").

A diffusion model reveals tokens in any order, and the stream shows only the final left-to-right text
(``StepEvent.text``). A token's logprobs go out with the chunk whose text completes the token's text: a token
revealed early waits until the text reaches it, a token that is part of a multi-byte character (a UTF-8 fragment,
text ending in U+FFFD) waits for the token that completes the character, and a token without text (a special token)
waits for the next token with text. What the text never reaches (tokens cut by a stop string, a trailing broken
character) goes out with the choice's last chunk, so the chunks' logprobs joined equal the non-streamed ones.
"""
from __future__ import annotations

from collections.abc import Callable

from unmask.engine import Revealed

REPLACEMENT = "\ufffd"
WINDOW = 6  # tokens decoded before the ones measured, so that a tokenizer's word-start rules see their context


class TokenCursor:
    """One choice: its revealed tokens, and how many of its left-to-right prefix the streamed text carries.

    Args:
        decode: token ids -> text, as the output's text is decoded (special tokens skipped).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.revealed: dict[int, Revealed] = {}
        self.ids: list[int] = []  # the revealed left-to-right prefix
        self.carried = 0          # tokens the text carries so far (handed out)
        self.covered = 0          # characters of their text
        self.shown = 0            # characters streamed

    def add(self, revealed: list[Revealed]) -> None:
        """The tokens one step revealed (or, on a revisable canvas, edited: the new token replaces the old, also in
        the prefix; only positions the text has not carried yet are ever edited, docs/design.md#http-contract)."""
        for r in revealed:
            self.revealed[r.position] = r
            if r.position < len(self.ids):
                self.ids[r.position] = r.token_id
        while len(self.ids) in self.revealed:
            self.ids.append(self.revealed[len(self.ids)].token_id)

    def advance(self, chars: int) -> list[Revealed]:
        """The tokens newly carried once ``chars`` more characters of text are streamed, in order."""
        self.shown += chars
        out: list[Revealed] = []
        while (group := self._group(self.carried)) is not None:
            end, length = group
            if self.covered + length > self.shown:
                break
            out += [self.revealed[j] for j in range(self.carried, end)]
            self.carried, self.covered = end, self.covered + length
        return out

    def _group(self, start: int) -> tuple[int, int] | None:
        """``(end, characters)`` of the shortest run of prefix tokens ``start..end-1`` whose text is not empty and
        ends in a whole character; None while the revealed prefix holds no such run."""
        s = max(0, start - WINDOW)
        before = len(self.decode(self.ids[s:start]))
        for end in range(start + 1, len(self.ids) + 1):
            text = self.decode(self.ids[s:end])
            if len(text) > before and not text.endswith(REPLACEMENT):
                return end, len(text) - before
        return None
