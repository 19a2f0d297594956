"""Self-distillation data: the AR parent answers a prompt file (the seed's "compute the targets from the teacher").

``distill(teacher, prompts, out)`` loads the parent (a Hugging Face directory, or a GGUF file / a directory holding
one, de-quantised by transformers), generates greedy answers in batches (left padding) with a tqdm bar, and
appends one JSON line per prompt to ``out``::

    {"prompt": str | null, "messages": [...] (chat prompts), "completion": str, "completion_ids": [int, ...],
     "finished": bool, "teacher": {"top_k": K, "ids": [[K]...], "logprobs": [[K]...]} (with top_k_dist)}

``completion_ids`` are the generated ids up to and including the first EOS/end-of-turn (``finished`` False when
``max_new_tokens`` ran out first); ``teacher`` holds, for every completion token, the parent's top-k next-token
distribution it was generated from (log-probabilities of the raw logits) - soft targets for ``--teacher-kl``.
Lines are flushed and fsynced as they are written; a rerun skips prompts already in ``out``, so an interrupted run
resumes.

With ``engine=True`` the teacher is a causal a2d checkpoint (e.g. the untrained prefix-causal conversion of the parent,
which the logit shift makes exactly its parent at ``block_size=1``) and unmask's own engine answers: one token per
forward, greedy, with continuous batching over the whole file (a finished answer's slot is refilled at the next
step and its record written at once, so records are in completion order) and, on a CPU,
the fbgemm-packed fp16 linear layers the server runs. The tokens are then the served checkpoint's own greedy
answers (what a drafter must predict) and come ~2x faster than transformers' padded batches on a 2-core CPU;
no ``teacher`` distributions (``top_k_dist`` must be 0).

The prompt file is JSONL (``{"prompt": str}`` or ``{"messages": [...]}`` without the final answer) or plain text
(one prompt per line). Chat prompts are rendered with the parent's chat template (generation prompt added).
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from .convert import ConversionError, eos_ids_of, load_parent
from .data import DataError, parse_json_line, text_lines


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """Prompts as ``[{"prompt": str} | {"messages": [...]}]`` with a ``key`` (the JSON used to skip done ones) and
    ``where`` (``file:line``, for messages about the prompt).

    Raises:
        DataError: missing/empty file, invalid JSON or fields (``file:line: reason``).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file (prompts)")
    out = []
    jsonl = path.suffix in (".jsonl", ".json")
    for _lineno, where, line in text_lines(path):
        if not jsonl:
            item = {"prompt": line.rstrip("\r\n")}
        else:
            obj = parse_json_line(line, where)
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object")
            if isinstance(obj.get("messages"), list) and obj["messages"]:
                msgs = obj["messages"]
                for i, m in enumerate(msgs):
                    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                            not isinstance(m.get("content"), str):
                        raise DataError(f"{where}: messages[{i}] must have string role and content")
                item = {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
            elif isinstance(obj.get("prompt"), str):
                item = {"prompt": obj["prompt"]}
            else:
                raise DataError(f"{where}: expected `prompt` (string) or `messages` (non-empty list)")
        item["key"] = json.dumps(item.get("messages", item.get("prompt")), ensure_ascii=False, sort_keys=True)
        item["where"] = where
        out.append(item)
    if not out:
        raise DataError(f"{path}: no prompts")
    return out


def done_keys(out: Path) -> set[str]:
    """Keys of prompts already answered in ``out``.

    Only a torn *last* line (no final newline: the writer was killed mid-line) is dropped, by truncating the file
    to the end of the line before it; blank lines are skipped.

    Raises:
        DataError: a complete line in the middle that is not a JSON object (``file:line``): the file was edited or
            joined by hand, and silently cutting it there would throw away every answer after it.
    """
    keys = set()
    if not out.is_file():
        return keys
    with open(out, "rb") as fh:
        data = fh.read()
    lines = data.splitlines(keepends=True)
    good = len(data)
    for n, raw in enumerate(lines, 1):
        if not raw.endswith(b"\n") and n == len(lines):
            good -= len(raw)  # torn last line: rewritten by this run
            break
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise DataError(f"{out}:{n}: not a JSON line ({type(exc).__name__}); fix or remove it") from None
        if not isinstance(obj, dict):
            raise DataError(f"{out}:{n}: expected a JSON object, got {type(obj).__name__}")
        key = obj["messages"][:-1] if isinstance(obj.get("messages"), list) else obj.get("prompt")
        keys.add(json.dumps(key, ensure_ascii=False, sort_keys=True))
    if good != len(data):
        with open(out, "r+b") as fh:
            fh.truncate(good)
    return keys


def _prompt_text(tok, item: dict) -> str:
    msgs = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
    if not getattr(tok, "chat_template", None):
        raise DataError("teacher: the tokenizer has no chat template")
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def generate_batch(model, tok, items: list[dict], max_new_tokens: int, top_k_dist: int = 0) -> list[dict]:
    """Greedy answers for ``items`` (left-padded batch). Returns the output records (see the module docstring)."""
    texts = [_prompt_text(tok, it) for it in items]
    pad_side = tok.padding_side
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    tok.padding_side = pad_side
    eos = sorted(set(eos_ids_of(tok)))
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, return_dict_in_generate=True,
                         output_logits=bool(top_k_dist), temperature=None, top_p=None, top_k=None)
    gen = out.sequences[:, enc["input_ids"].shape[1]:].cpu()
    records = []
    for b, it in enumerate(items):
        ids = gen[b].tolist()
        finished = False
        for j, t in enumerate(ids):
            if t in eos:
                ids = ids[: j + 1]
                finished = True
                break
        rec = {"prompt": it.get("prompt"), "completion": tok.decode(ids, skip_special_tokens=True),
               "completion_ids": ids, "finished": finished}
        if "messages" in it:
            rec["messages"] = it["messages"] + [{"role": "assistant", "content": rec["completion"]}]
        if top_k_dist:
            t_ids, t_lps = [], []
            for j in range(len(ids)):
                lp = torch.log_softmax(out.logits[j][b].float().cpu(), -1)
                v, i = lp.topk(top_k_dist)
                t_ids.append(i.tolist())
                t_lps.append([round(float(x), 5) for x in v])
            rec["teacher"] = {"top_k": top_k_dist, "ids": t_ids, "logprobs": t_lps}
        records.append(rec)
    return records


class TransformersTeacher:
    """The AR parent run by transformers as a distillation teacher: greedy answers in left-padded batches.

    Args:
        path: see :func:`load_parent`.
        device: ``cpu`` | ``cuda`` | ``auto``.

    Attributes:
        context: the parent's context length in tokens (``max_position_embeddings``).

    Raises:
        DataError: see :func:`load_parent`.
    """

    def __init__(self, path: str | os.PathLike, batch_size: int, device: str = "cpu", top_k_dist: int = 0):
        try:
            self.model, self.tokenizer = load_parent(path, device=device)
        except ConversionError as exc:
            raise DataError(f"teacher: {exc}") from exc
        self.batch_size, self.top_k_dist = batch_size, top_k_dist
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)

    def prompt_length(self, item: dict) -> int:
        """Tokens of ``item``'s chat-rendered prompt (generation prompt included)."""
        return len(self.tokenizer(_prompt_text(self.tokenizer, item), add_special_tokens=False).input_ids)

    def answer_iter(self, items: list[dict], max_new_tokens: int) -> Iterator[tuple[int, dict]]:
        """Greedy answers for ``items``, ``batch_size`` at a time (see :func:`generate_batch`): ``(index,
        record)``, a batch's records together. A prompt within ``max_new_tokens`` of the end of the context is
        answered alone with the tokens that fit (``finished`` False if none was EOS), after the others."""
        room = {i: self.context - self.prompt_length(it) for i, it in enumerate(items)}
        fits = [i for i in range(len(items)) if room[i] >= max_new_tokens]
        for lo in range(0, len(fits), self.batch_size):
            idx = fits[lo: lo + self.batch_size]
            recs = generate_batch(self.model, self.tokenizer, [items[i] for i in idx], max_new_tokens,
                                  self.top_k_dist)
            yield from zip(idx, recs)
        for i in (i for i in range(len(items)) if 1 <= room[i] < max_new_tokens):
            yield i, generate_batch(self.model, self.tokenizer, [items[i]], room[i], self.top_k_dist)[0]


class EngineTeacher:
    """The engine as a distillation teacher: greedy ``block_size=1`` answers of an a2d checkpoint.

    Args:
        checkpoint: an a2d checkpoint directory with causal committed context (``prefix_causal`` or
            ``block_causal`` attention) and the logit shift, e.g. the output of ``unmask convert``. An answer
            ends at the same ids as with the transformers teacher (:func:`~unmask.training.convert.eos_ids_of`: the
            tokenizer's EOS and end-of-turn ids) and at ``dllm.eos_token_ids``.
        batch_size: sequences decoded together (continuous batching).
        device: ``cpu`` | ``cuda`` | ``auto``.

    Attributes:
        context: the checkpoint's context length in tokens.

    Raises:
        DataError: the checkpoint cannot be loaded, has no logit shift or has bidirectional attention (block-1
            decoding would then not be its parent's AR path).
    """

    def __init__(self, checkpoint: str | os.PathLike, batch_size: int, device: str = "cpu"):
        from unmask.engine import LLM

        p = Path(checkpoint).expanduser()
        if not (p / "config.json").is_file():
            raise DataError(f"{p}: not an a2d checkpoint directory (no config.json); --engine needs one, e.g. the "
                            f"output of `unmask convert`")
        try:
            self.llm = LLM(str(p), device=device, max_batch_size=batch_size)
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(f"{p}: cannot load the checkpoint with the engine ({exc})") from exc
        if not self.llm.model.dllm.logit_shift:
            raise DataError(f"{p}: dllm.logit_shift is false; --engine needs a checkpoint converted with the logit "
                            f"shift (block_size=1 is then the parent's AR decoding)")
        if self.llm.model.dllm.attention == "bidirectional":
            raise DataError(f"{p}: dllm.attention is bidirectional; --engine needs causal committed context "
                            f"(prefix_causal or block_causal) for block_size=1 to be the parent's AR decoding")
        self.tokenizer = self.llm.tokenizer
        self.context = int(self.llm.model.max_context)
        dllm_eos = set(self.llm.model.dllm.eos_token_ids)
        self.stop_ids = sorted(set(eos_ids_of(self.tokenizer)) - dllm_eos)  # ids the engine would not stop at itself

    def _prompt_ids(self, item: dict) -> list[int]:
        return self.llm.apply_chat_template(item.get("messages") or [{"role": "user", "content": item["prompt"]}])

    def prompt_length(self, item: dict) -> int:
        """Tokens of ``item``'s chat-rendered prompt (generation prompt included)."""
        return len(self._prompt_ids(item))

    def answer_iter(self, items, max_new_tokens: int) -> Iterator[tuple[int, dict]]:
        """Greedy answers for ``items`` (an iterable, read lazily) as they finish, in completion order:
        ``(index in items, record)``, records as in the module docstring, without ``teacher``. Continuous batching: a finished answer's slot is refilled
        at the next step. A prompt too close to the end of the context gets the tokens that fit (``finished``
        False if none was EOS).

        Raises:
            ParamError: a prompt leaves no room in the context (:func:`distill` skips those beforehand).
        """
        from unmask.engine import SamplingParams

        queued: list[dict] = []

        def requests():
            for it in items:
                ids = self._prompt_ids(it)
                queued.append(it)
                yield ids, SamplingParams(max_tokens=min(max_new_tokens, self.context - len(ids)), temperature=0.0,
                                          block_size=1, speculative=False, stop_token_ids=self.stop_ids)

        for i, res in self.llm.generate_iter(requests()):
            it, out = queued[i], res.outputs[0]
            ids = list(out.token_ids)
            rec = {"prompt": it.get("prompt"), "completion": self.tokenizer.decode(ids, skip_special_tokens=True),
                   "completion_ids": ids, "finished": out.finish_reason == "stop"}
            if "messages" in it:
                rec["messages"] = it["messages"] + [{"role": "assistant", "content": rec["completion"]}]
            yield i, rec

    def answer(self, items: list[dict], max_new_tokens: int) -> list[dict]:
        """:meth:`answer_iter` in the order of ``items``."""
        return [rec for _, rec in sorted(self.answer_iter(items, max_new_tokens), key=lambda x: x[0])]


def distill(teacher: str | os.PathLike, prompts: str | os.PathLike, out: str | os.PathLike, max_new_tokens: int = 128,
            batch_size: int = 8, top_k_dist: int = 0, device: str = "cpu", progress: bool = True,
            engine: bool = False) -> dict:
    """Answer every prompt not yet in ``out`` with the parent and append the records (resumable).

    Args:
        engine: answer with unmask's engine from an a2d checkpoint (:class:`EngineTeacher`) instead of
            transformers: continuous batching over the whole file, each record written (and fsynced) as its answer
            finishes, so records are in completion order. Without it records are written a batch at a time.

    A prompt that fills the teacher's context (no room for one new token) is not answered: a warning names its
    ``file:line`` and it is counted in ``too_long`` (a rerun warns again and goes on; it never stops the run).

    Returns:
        ``{"total", "skipped", "written", "too_long"}`` counts (``skipped``: already answered in ``out``).

    Raises:
        DataError: bad prompt file or teacher path. ValueError: non-positive sizes, or ``top_k_dist`` with
            ``engine``.
    """
    if max_new_tokens < 1 or batch_size < 1 or top_k_dist < 0:
        raise ValueError("max-new-tokens and batch-size must be >= 1, top-k-dist >= 0")
    if engine and top_k_dist:
        raise ValueError("top-k-dist: the engine teacher stores no teacher distributions; drop --top-k-dist or "
                         "--engine")
    items = read_prompts(prompts)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_keys(out)
    todo = [it for it in items if it["key"] not in done]
    stats = {"total": len(items), "skipped": len(items) - len(todo), "written": 0, "too_long": 0}
    if not todo:
        return stats
    runner = (EngineTeacher(teacher, batch_size, device=device) if engine
              else TransformersTeacher(teacher, batch_size, device=device, top_k_dist=top_k_dist))
    fits = []
    for it in todo:
        n = runner.prompt_length(it)
        if n >= runner.context:
            warnings.warn(f"{it['where']}: the prompt has {n} tokens and fills the teacher's context of "
                          f"{runner.context} tokens; skipped", stacklevel=2)
            stats["too_long"] += 1
        else:
            fits.append(it)
    todo = fits
    from tqdm.auto import tqdm

    bar = tqdm(total=len(items), initial=stats["skipped"] + stats["too_long"], desc="distill", unit="prompt",
               disable=not progress)
    with open(out, "a", encoding="utf-8") as fh:
        for _, rec in runner.answer_iter(todo, max_new_tokens):
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())  # a kill loses at most the answer being written (a torn last line)
            stats["written"] += 1
            bar.update(1)
    bar.close()
    return stats
