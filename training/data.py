"""Training data for A2D fine-tuning: JSONL chats rendered by the chat template, labels on assistant tokens only.

Input lines (docs/design.md#training, issue 4), one JSON object per line:

* ``{"messages": [{"role": "system"|"user"|"assistant"|..., "content": str}, ...]}`` - every assistant turn is
  trained, everything else is context;
* ``{"prompt": str, "completion": str, "system": str (optional)}`` - one user turn and one assistant turn;
* distill-data output (``unmask distill-data``): ``prompt`` + ``completion`` + ``completion_ids`` (the teacher's
  generated token ids, used as is so that the stored top-k distributions stay aligned) + optional
  ``teacher: {"top_k": K, "ids": [[K ints] per completion token], "logprobs": [[K floats] ...]}``.

Answer tokens ("labels") are found by rendering prefixes of the conversation: the text rendered for
``messages[:i]`` with the generation prompt is a prefix of the text for ``messages[:i+1]``; the characters between
them are assistant turn i. Tokens whose characters start inside that span are answer tokens, cut after the turn's
end-of-turn/EOS token (so the EOS after each answer is trained, the template's trailing newline is context; a
template that writes no end-of-turn token gets the tokenizer's EOS inserted after each answer). The
prompt is never a label. Every example is one row of at most ``seq_len`` tokens (truncated on the right, never
packed together with another document, so attention never crosses documents).

Errors name ``file:line`` and the reason (:class:`DataError`).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .common import eos_ids_of  # training's one EOS rule (named here too, for the data loader's callers)


class DataError(ValueError):
    """A data file is missing, empty, malformed (message ``file:line: reason``) or has no assistant tokens."""


@dataclass
class Example:
    """One tokenised training document.

    Attributes:
        input_ids: ``[L]`` token ids (prompt, answers, later turns), ``L <= seq_len``.
        answer: ``[L]`` bools, True on assistant (label) tokens, including each turn's end-of-turn token.
        spans: ``[(start, end), ...]`` half-open answer spans (one per assistant turn), ascending.
        teacher_ids, teacher_logprobs: ``[n_answer, K]`` top-k token ids / log-probabilities of the parent's
            next-token distribution for each answer token in order (distill-data soft targets), or None.
        where: ``file:line`` of the source line (for messages).
    """

    input_ids: list[int]
    answer: list[bool]
    spans: list[tuple[int, int]]
    teacher_ids: list[list[int]] | None = None
    teacher_logprobs: list[list[float]] | None = None
    where: str = ""

    @property
    def n_answer(self) -> int:
        """Number of answer (label) tokens."""
        return sum(self.answer)


@dataclass
class Dataset:
    """Examples of one file plus the count of examples dropped because truncation left no answer token."""

    examples: list[Example]
    dropped: int = 0
    path: str = ""
    teacher_top_k: int = 0

    def __len__(self) -> int:
        return len(self.examples)


def _spans_from_ids(ids: list[int], eos_ids: set[int], span: tuple[int, int]) -> tuple[int, int]:
    """Cut an answer span after its first end-of-turn/EOS token (the template's trailing text is context); a span
    without one takes the end-of-turn token right after it, when there is one."""
    s, e = span
    for j in range(s, e):
        if ids[j] in eos_ids:
            return s, j + 1
    if e < len(ids) and ids[e] in eos_ids:  # a span located by its content alone: the turn's closing token
        return s, e + 1
    return s, e


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise DataError(f"{where}: messages[{i}].role must be a non-empty string")
        if not isinstance(content, str):
            raise DataError(f"{where}: messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message (nothing to train on)")
    return out


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises template-specific errors (e.g. role order)
        raise DataError(f"{where}: the chat template cannot render these messages ({exc})") from exc


def tokenize_chat(tokenizer, messages: list[dict], eos_ids: set[int], where: str = "") -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of a rendered chat and the token spans of its assistant turns.

    Args:
        tokenizer: a fast tokenizer with a chat template (offsets are needed).
        messages: validated ``[{"role", "content"}]``.
        eos_ids: EOS / end-of-turn ids; an answer span ends after the first of them (or at the turn's end).
        where: ``file:line`` for errors.

    Returns:
        ``(ids, spans)``: ``ids`` the tokenised full render (no special tokens added: the template writes them),
        ``spans`` half-open token spans of assistant turns.

    Raises:
        DataError: the template cannot render the chat, or an assistant turn could not be located.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template")
    full = _render(tokenizer, messages, False, where)
    char_spans = []
    search_from = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # the render up to this turn's content, generation prompt (role header) included; for a chat that opens
        # with an assistant turn that is the empty chat's render (a template may also add a system preamble)
        try:
            before = _render(tokenizer, messages[:i], True, where)
        except DataError:
            if i:
                raise
            before = None  # the template cannot render an empty chat: locate the content instead
        through = _render(tokenizer, messages[: i + 1], False, where)
        if (before is not None and full.startswith(through) and through.startswith(before)
                and len(before) >= search_from):
            char_spans.append((len(before), len(through)))
            search_from = len(through)
            continue
        # templates that rewrite earlier turns (e.g. strip reasoning): locate the content in the full render
        idx = full.find(m["content"], search_from) if m["content"] else -1
        if idx < 0:
            raise DataError(f"{where}: cannot locate assistant turn {i} in the rendered chat (the chat template "
                            "renders prefixes inconsistently)")
        char_spans.append((idx, idx + len(m["content"])))
        search_from = idx + len(m["content"])
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = enc["offset_mapping"]
    spans = []
    for cs, ce in char_spans:
        toks = [j for j, (a, b) in enumerate(offsets) if cs <= a < ce and b > a]
        if not toks:
            continue
        spans.append(_spans_from_ids(ids, eos_ids, (toks[0], toks[-1] + 1)))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:  # a template that does not close assistant turns: the EOS after each answer is trained
        for i in range(len(spans) - 1, -1, -1):
            s, e = spans[i]
            if not any(t in eos_ids for t in ids[s:e]):
                ids.insert(e, int(eos))
                spans[i] = (s, e + 1)
                spans[i + 1:] = [(a + 1, b + 1) for a, b in spans[i + 1:]]
    return ids, spans


def _line_messages(obj: dict, where: str) -> list[dict]:
    if "messages" in obj:
        return _check_messages(obj["messages"], where)
    if "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        if not isinstance(p, str):
            raise DataError(f"{where}: `prompt` must be a string")
        if not isinstance(c, str):
            raise DataError(f"{where}: `completion` must be a string")
        msgs = []
        if obj.get("system") is not None:
            if not isinstance(obj["system"], str):
                raise DataError(f"{where}: `system` must be a string")
            msgs.append({"role": "system", "content": obj["system"]})
        return msgs + [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    raise DataError(f"{where}: expected `messages` or `prompt` + `completion`, got keys {sorted(obj)}")


def _teacher_fields(obj: dict, n: int, where: str,
                    vocab_size: int) -> tuple[list[list[int]], list[list[float]], int] | None:
    t = obj.get("teacher")
    if t is None:
        return None
    if not isinstance(t, dict) or not isinstance(t.get("ids"), list) or not isinstance(t.get("logprobs"), list):
        raise DataError(f"{where}: `teacher` must be an object with `ids` and `logprobs` lists")
    ids, lps = t["ids"], t["logprobs"]
    if len(ids) != n or len(lps) != n:
        raise DataError(f"{where}: `teacher` has {len(ids)} ids / {len(lps)} logprobs rows for {n} completion tokens")
    k = len(ids[0]) if ids and isinstance(ids[0], list) else 0
    if n and k < 1:
        raise DataError(f"{where}: `teacher` rows must be non-empty lists (top-k >= 1)")
    for r, (a, b) in enumerate(zip(ids, lps)):
        if not isinstance(a, list) or not isinstance(b, list) or len(a) != k or len(b) != k:
            raise DataError(f"{where}: teacher row {r}: expected a list of {k} ids and a list of {k} logprobs")
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab_size for x in a):
            raise DataError(f"{where}: teacher row {r}: ids must be token ids in [0, {vocab_size})")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 and not math.isnan(x)
                   for x in b):
            raise DataError(f"{where}: teacher row {r}: logprobs must be numbers <= 0 (log-probabilities)")
    return ids, lps, k


def build_example(obj: Any, tokenizer, seq_len: int, eos_ids: set[int], where: str) -> Example | None:
    """Tokenise one JSONL object (see the module docstring). Returns None when truncation to ``seq_len`` leaves no
    answer token.

    Raises:
        DataError: the object is malformed (message names ``where`` and the field).
    """
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    messages = _line_messages(obj, where)
    teacher = None
    if "completion_ids" in obj:
        cids = obj["completion_ids"]
        if not isinstance(cids, list) or not cids or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(tokenizer) for x in cids):
            raise DataError(f"{where}: `completion_ids` must be a non-empty list of token ids in "
                            f"[0, {len(tokenizer)})")
        if messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: `completion_ids` needs the last message to be the assistant's")
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where}: the tokenizer has no chat template")
        prefix = _render(tokenizer, messages[:-1], True, where)
        pids = list(tokenizer(prefix, add_special_tokens=False).input_ids)
        ids = pids + list(cids)
        spans = [(len(pids), len(ids))]
        teacher = _teacher_fields(obj, len(cids), where, len(tokenizer))
    else:
        ids, spans = tokenize_chat(tokenizer, messages, eos_ids, where)
        if "teacher" in obj:
            raise DataError(f"{where}: `teacher` distributions need `completion_ids` (distill-data output)")
    vocab = len(tokenizer)
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise DataError(f"{where}: token id {bad[0]} is outside the tokenizer's vocabulary ({vocab})")
    ids = ids[:seq_len]
    spans = [(s, min(e, seq_len)) for s, e in spans if s < seq_len]
    if not spans:
        return None
    answer = [False] * len(ids)
    for s, e in spans:
        for j in range(s, e):
            answer[j] = True
    ex = Example(input_ids=ids, answer=answer, spans=spans, where=where)
    if teacher is not None:
        t_ids, t_lps, _k = teacher
        n = spans[0][1] - spans[0][0]
        ex.teacher_ids, ex.teacher_logprobs = t_ids[:n], t_lps[:n]
    return ex


def text_lines(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line number, "file:line", text)`` of every non-blank line of a UTF-8 text file.

    Raises:
        DataError: a line that is not UTF-8 (``file:line``).
    """
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 (byte {exc.start})") from None
            if line.strip():
                yield lineno, where, line


def parse_json_line(line: str, where: str) -> Any:
    """``json.loads`` with errors as :class:`DataError` naming ``where`` (``file:line``).

    Raises:
        DataError: invalid JSON, or JSON nested too deeply for the parser.
    """
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    except RecursionError:
        raise DataError(f"{where}: invalid JSON (nested too deeply)") from None


def load_dataset(path: str | Path, tokenizer, seq_len: int, eos_ids: set[int] | None = None) -> Dataset:
    """Read and tokenise a JSONL training file.

    Args:
        path: JSONL file (blank lines are skipped).
        tokenizer: the checkpoint's tokenizer (chat template required).
        seq_len: maximum tokens per row (>= 2); longer documents are truncated on the right.
        eos_ids: end-of-turn ids (default: :func:`eos_ids_of`).

    Raises:
        DataError: missing file, invalid JSON or fields (``file:line: reason``), an empty file, or no example with
            an assistant token after truncation.
    """
    path = Path(path)
    if seq_len < 2:
        raise DataError(f"seq_len: must be at least 2, got {seq_len}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    eos_ids = set(eos_ids) if eos_ids is not None else set(eos_ids_of(tokenizer))
    examples, dropped, top_k, lines = [], 0, 0, 0
    for _lineno, where, line in text_lines(path):
        lines += 1
        obj = parse_json_line(line, where)
        ex = build_example(obj, tokenizer, seq_len, eos_ids, where)
        if ex is None:
            dropped += 1
            continue
        if ex.teacher_ids is not None:
            k = len(ex.teacher_ids[0]) if ex.teacher_ids else 0
            if top_k and k != top_k:
                raise DataError(f"{where}: teacher top-k {k} differs from earlier lines ({top_k})")
            top_k = k
        examples.append(ex)
    if lines == 0:
        raise DataError(f"{path}: empty file (expected JSONL lines with `messages` or `prompt`/`completion`)")
    if not examples:
        raise DataError(f"{path}: no assistant tokens in any of {lines} examples within --seq-len {seq_len}")
    return Dataset(examples=examples, dropped=dropped, path=str(path), teacher_top_k=top_k)


@dataclass
class Batch:
    """Right-padded batch of examples.

    Attributes:
        input_ids: ``[B, L]`` int64 (pad = ``pad_id``). valid: ``[B, L]`` bool. answer: ``[B, L]`` bool labels mask.
        spans: per row, the answer spans. teacher_ids / teacher_logprobs: ``[B, L, K]`` int64 / float32 top-k of
            the parent's next-token distribution for the answer token at each position (elsewhere ids 0 and
            log-probabilities ``-inf``), or None.
        has_teacher: ``[B, L]`` bool, True where a teacher distribution is stored.
    """

    input_ids: torch.Tensor
    valid: torch.Tensor
    answer: torch.Tensor
    spans: list[list[tuple[int, int]]]
    teacher_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    has_teacher: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        """Non-padding tokens in the batch (True entries of ``valid``)."""
        return int(self.valid.sum())


def collate(examples: list[Example], pad_id: int, top_k: int = 0) -> Batch:
    """Pad ``examples`` to the longest one (``[B, L]``); stored teacher top-k rows go to their answer positions."""
    B = len(examples)
    L = max(len(e.input_ids) for e in examples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    answer = torch.zeros(B, L, dtype=torch.bool)
    t_ids = t_lp = has_t = None
    if top_k:
        t_ids = torch.zeros(B, L, top_k, dtype=torch.long)
        t_lp = torch.full((B, L, top_k), -math.inf, dtype=torch.float32)
        has_t = torch.zeros(B, L, dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        ids[b, :n] = torch.tensor(e.input_ids)
        valid[b, :n] = True
        answer[b, :n] = torch.tensor(e.answer)
        if top_k and e.teacher_ids is not None and e.teacher_ids:
            s = e.spans[0][0]
            m = len(e.teacher_ids)
            t_ids[b, s:s + m] = torch.tensor(e.teacher_ids)
            t_lp[b, s:s + m] = torch.tensor(e.teacher_logprobs, dtype=torch.float32)
            has_t[b, s:s + m] = True
    return Batch(input_ids=ids, valid=valid, answer=answer, spans=[list(e.spans) for e in examples],
                 teacher_ids=t_ids, teacher_logprobs=t_lp, has_teacher=has_t)
