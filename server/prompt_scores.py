"""Prompt log-probabilities in responses (docs/api-fields.md, docs/design.md#http-contract): completions ``echo`` +
``logprobs`` (the prompt's tokens first in ``choices[i].logprobs``, the first token's ``null``, as OpenAI's
legacy completions) and vLLM's ``prompt_logprobs`` (per prompt token ``null`` or ``{token_id: {logprob, rank,
decoded_token}}``, on each completions choice, on the chat response), both with the extension
``prompt_log_likelihood``: ``{value, stderr, method, samples, seed}`` (``method``: ``causal``, exact, ``stderr``
0; ``monte_carlo``, an estimate, docs/design.md#http-contract). The engine computes the scores
(``AsyncEngine.score``); ``max_tokens: 0`` answers with the prompt alone (lm-eval's log-likelihood requests).
"""
from __future__ import annotations

from unmask.engine import ParamError

LOGPROB_FLOOR = -9999.0  # as render.py's: JSON has no -inf


def _floor(lp: float | None) -> float | None:
    return None if lp is None else max(lp, LOGPROB_FLOOR)


def wanted(body) -> bool:
    """Whether the request asks for the prompt's log-probabilities."""
    return getattr(body, "prompt_logprobs", None) is not None or (
        getattr(body, "echo", False) and getattr(body, "logprobs", None) is not None)


def top_k(body) -> int:
    """Alternatives per prompt token: the larger of completions' ``logprobs`` (with ``echo``) and
    ``prompt_logprobs``."""
    echo_k = (body.logprobs or 0) if getattr(body, "echo", False) and isinstance(body.logprobs, int) else 0
    return max(echo_k, getattr(body, "prompt_logprobs", None) or 0)


async def score_all(engine, body, prompts: list[list[int]]) -> list | None:
    """The engine's scores of each prompt, or None when not asked for.

    Raises:
        ParamError: (a 400) the model cannot score prompts, a prompt is too long, samples out of range.
    """
    if not wanted(body):
        return None
    samples = getattr(body, "prompt_logprobs_samples", None)
    out = []
    for i, ids in enumerate(prompts):
        try:
            out.append(await engine.score(ids, top_k(body), samples, body.seed or 0))
        except ParamError as exc:
            raise ParamError(f"prompt.{i}", exc.reason) if exc.field == "prompt" and len(prompts) > 1 else exc
    return out


def likelihood(scores) -> dict:
    """The ``prompt_log_likelihood`` extension: the sum of the prompt's log-probabilities, its standard error
    (0 when exact), the method, and the Monte-Carlo draws and seed (0 and null when exact)."""
    return {"value": scores.total, "stderr": scores.stderr, "method": scores.method, "samples": scores.samples,
            "seed": scores.seed}


def vllm_prompt_logprobs(scores, k: int, token_text) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per token None (the first) or ``{str(id): {logprob, rank, decoded_token}}``, the
    token itself and its ``k`` likeliest alternatives (rank null on a Monte-Carlo estimate)."""
    out: list[dict | None] = [None]
    for i in range(1, len(scores.token_ids)):
        t = scores.token_ids[i]
        entry = {str(t): {"logprob": _floor(scores.logprobs[i]), "rank": scores.ranks[i],
                          "decoded_token": token_text(t)}}
        if not scores.estimate:
            ranked = sorted((scores.top[i] or {}).items(), key=lambda kv: -kv[1])[:k]
            for r, (a, lp) in enumerate(ranked, 1):
                entry.setdefault(str(a), {"logprob": _floor(lp), "rank": r, "decoded_token": token_text(a)})
        out.append(entry)
    return out


def echo_logprobs(scores, k: int, token_text) -> dict:
    """Completions' ``logprobs`` object of the prompt's tokens (``echo``): tokens, token_logprobs (first null),
    top_logprobs (first null; the token itself always listed), text_offset from 0."""
    tokens, offsets, tops, offset = [], [], [], 0
    for i, t in enumerate(scores.token_ids):
        text = token_text(t)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if i == 0:
            tops.append(None)
            continue
        alts = {} if scores.estimate else {token_text(a): _floor(lp) for a, lp in
                                           sorted((scores.top[i] or {}).items(), key=lambda kv: -kv[1])[:k]}
        alts.setdefault(text, _floor(scores.logprobs[i]))
        tops.append(alts)
    return {"tokens": tokens, "token_logprobs": [_floor(v) for v in scores.logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def add_to_body(result: dict, kind: str, body, scores: list, n: int, token_text) -> dict:
    """Put the prompts' scores into a finished response body (``choices[i]`` belongs to prompt ``i // n``)."""
    k = top_k(body)
    if kind == "chat":
        result["prompt_logprobs"] = vllm_prompt_logprobs(scores[0], k, token_text)
        result["prompt_log_likelihood"] = likelihood(scores[0])
        return result
    for i, choice in enumerate(result["choices"]):
        s = scores[i // n]
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(s, k, token_text)
        choice["prompt_log_likelihood"] = likelihood(s)
        if body.echo and body.logprobs is not None:
            head = echo_logprobs(s, k, token_text)
            gen = choice.get("logprobs") or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                             "text_offset": []}
            shift = sum(len(t) for t in head["tokens"])  # the generated tokens' offsets follow the prompt's
            choice["logprobs"] = {
                "tokens": head["tokens"] + gen["tokens"],
                "token_logprobs": head["token_logprobs"] + gen["token_logprobs"],
                "top_logprobs": head["top_logprobs"] + (gen["top_logprobs"] or []),
                "text_offset": head["text_offset"] + [o + shift for o in gen["text_offset"]]}
    return result


def prompt_only_body(response_id: str, created: int, model: str, body, prompts: list[list[int]], echo: list[str],
                     scores: list, n: int, token_text) -> dict:
    """The completions body of ``max_tokens: 0``: each choice the prompt alone (its text with ``echo``), finish
    reason ``length``, no completion tokens."""
    choices = [{"index": i, "text": echo[i // n] if body.echo else "", "logprobs": None, "finish_reason": "length"}
               for i in range(len(prompts) * n)]
    prompt_tokens = sum(len(p) for p in prompts) * n
    result = {"id": response_id, "object": "text_completion", "created": created, "model": model,
              "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                            "total_tokens": prompt_tokens, "prompt_tokens_details": {
                                                "cached_tokens": 0}, "nfe": 0, "denoising_steps": 0}}
    return add_to_body(result, "completion", body, scores, n, token_text)
