"""Offline Python API in vLLM's style: ``LLM(model).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import replace

from .denoiser import Denoiser
from .model import LoadedModel, load_model
from .outputs import RequestOutput, StepEvent
from .params import MAX_SEED, ParamError, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import SpeculativeSequence

_ids = itertools.count()


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    """Token ids of a prompt: a string is tokenised with the tokenizer's special tokens (e.g. BOS); a list of ids
    is returned as a copy."""
    if isinstance(prompt, list):
        return list(prompt)
    return list(tokenizer(prompt).input_ids)


def chat_prompt_ids(tokenizer, messages: list[dict], chat_template: str | None = None) -> list[int]:
    """Token ids of a chat (``[{"role", "content"}, ...]``) rendered by the model's chat template (or
    ``chat_template``, a Jinja string) with the generation prompt; the rendered text is tokenised without adding
    special tokens again (the template writes them).

    Raises:
        ParamError: (field ``messages``) the tokenizer has no chat template and none was given.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ParamError("messages", "this model has no chat template; pass --chat-template or use completions")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def make_sequences(model: LoadedModel, prompt_ids: list[int], params: SamplingParams, request_id: str,
                   n: int = 1, choice_ids: bool = False) -> list[Sequence]:
    """The sequences of one request: ``n`` choices with seeds seed, seed+1, ... (DESIGN.md section 10).

    Shared by :class:`LLM` and :class:`~unmask.engine.async_engine.AsyncEngine` so that both decode a request
    identically.

    Args:
        model: the loaded model (its ``dllm.default_sampling`` resolves ``temperature``; a missing seed is drawn
            at random once per request).
        prompt_ids: prompt token ids. params: the request's parameters. request_id: id put on the events.
        n: number of choices (>= 1).
        choice_ids: ignored (kept for old callers): every choice carries ``request_id`` and its ``index``.

    A request that gets speculative decoding only from the checkpoint's default, without naming a draft block,
    branches, epsilon or ratio, drafts only where the model's ``draft_policy`` says so
    (:meth:`~unmask.engine.model.LoadedModel.drafts_by_default`); otherwise it decodes one token per forward
    (draft block 1) through the same verifying path - the same tokens, or for sampling the same distribution.

    Raises:
        ParamError: ``n`` is not a positive integer, or a parameter this model cannot honour (names the field).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParamError("n", f"must be a positive integer, got {n!r}")
    resolved = params.with_defaults(model.dllm.default_sampling, model.dllm.block_size)
    if (resolved.speculative and params.speculative is None and params.block_size is None
            and params.speculative_branches is None and params.speculative_epsilon is None
            and params.speculative_ratio is None and params.speculative_no_repeat_ngram is None
            and not model.drafts_by_default()):
        resolved = replace(resolved, block_size=1)
    kind = SpeculativeSequence if resolved.speculative else Sequence
    extra = {"draft_head": model.draft_head} if resolved.speculative else {}
    return [kind(request_id, prompt_ids, replace(resolved, seed=(resolved.seed + i) % (MAX_SEED + 1)), model.dllm,
                 model.tokenizer, model.max_context, model.device, vocab_size=model.vocab_size, index=i, **extra)
            for i in range(n)]


class LLM:
    """A diffusion LM with continuous batching, for scripts and tests.

    Args:
        model: checkpoint directory / hub id, or an already :class:`LoadedModel`.
        family: force a family (default: detect). device/dtype: ``auto`` or explicit.
        weights: ``auto`` | ``native`` | ``fp16``: how the linear layers run (:func:`load_model`; a path only).
        max_batch_size: sequences decoded together.
        compile: ``torch.compile`` the decoder forward (see :class:`~unmask.engine.denoiser.Denoiser`).

    Example::

        llm = LLM("runs/smollm2-a2d")
        out = llm.generate("Name three colours.", SamplingParams(max_tokens=32, temperature=0))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | LoadedModel, family: str | None = None, device: str = "auto",
                 dtype: str = "auto", max_batch_size: int = 16, compile: bool = False, weights: str = "auto"):
        if compile and weights == "auto":
            weights = "native"  # torch.compile traces the weights as loaded, not fbgemm's packed kernels
        self.model = (model if isinstance(model, LoadedModel)
                      else load_model(model, family, device, dtype, weights=weights))
        self.denoiser = Denoiser(self.model, compile=compile)
        self.max_batch_size = max_batch_size

    @property
    def tokenizer(self):
        """The loaded model's Hugging Face tokenizer."""
        return self.model.tokenizer

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (see :func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None) -> list[int]:
        """Token ids of a chat rendered with the generation prompt (see :func:`chat_prompt_ids`)."""
        return chat_prompt_ids(self.tokenizer, messages, chat_template)

    def make_sequences(self, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1
                       ) -> list[Sequence]:
        """Sequences for one request (see :func:`make_sequences`)."""
        return make_sequences(self.model, prompt_ids, params, request_id, n)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: str | list[int] | list[str | list[int]], params: SamplingParams | None = None,
                 n: int = 1) -> list[RequestOutput]:
        """Generate for one or many prompts (strings or token-id lists), batched. Returns one
        :class:`RequestOutput` per prompt, in order.

        Raises:
            ParamError: invalid parameters for this model (names the field).
        """
        params = params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        # lookahead = every prompt: all requests are built (and checked) before the first step runs
        for i, out in self.generate_iter(((p, params) for p in prompts), n=n, lookahead=len(prompts)):
            outputs[i] = out
        return outputs

    def generate_iter(self, requests, n: int = 1, lookahead: int | None = None
                      ) -> Iterator[tuple[int, RequestOutput]]:
        """Continuous batching over a stream of requests: yields ``(index, RequestOutput)`` as each request
        finishes (completion order, not input order), reading ``requests`` lazily.

        Args:
            requests: iterable of ``(prompt, SamplingParams)`` (a prompt: string or token ids); each request has
                its own parameters (batch invariance: its tokens are those it gets alone).
            n: choices per request.
            lookahead: requests read ahead of the running batch (default ``max_batch_size``: a finished request's
                slot is refilled at the next step, so the batch never drains while requests remain); counted as
                ``lookahead x n`` sequences.

        Raises:
            ParamError: a request's parameters are invalid for this model (names the field); the requests that
                finished before it have been yielded.
        """
        sched = Scheduler(self.denoiser, max_batch_size=self.max_batch_size)
        ahead = self.max_batch_size if lookahead is None else max(1, lookahead)
        pending: dict[str, tuple[int, RequestOutput, list[Sequence], float]] = {}
        source = enumerate(requests)
        exhausted = False
        while True:
            while not exhausted and len(sched.waiting) + len(sched.running) < self.max_batch_size + ahead * n:
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                    break
                i, (prompt, params) = nxt
                rid = f"gen-{next(_ids)}"
                ids = self.encode(prompt)
                seqs = self.make_sequences(ids, params or SamplingParams(), rid, n)
                pending[rid] = (i, RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids), seqs,
                                time.time())
                sched.waiting.extend(seqs)
            if not sched.has_work():
                return
            sched.step()
            for rid in [r for r, (_, _, seqs, _) in pending.items() if all(s.finished for s in seqs)]:
                i, out, seqs, t0 = pending.pop(rid)
                out.outputs = [s.completion() for s in seqs]
                out.seconds = max((s.finish_time or time.time()) for s in seqs) - t0
                firsts = [s.first_token_time for s in seqs if s.first_token_time]
                out.time_to_first_token = (min(firsts) - t0) if firsts else None
                yield i, out

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             chat_template: str | None = None) -> RequestOutput:
        """Generate one answer to a chat (``[{"role", "content"}, ...]``)."""
        return self.generate([self.apply_chat_template(messages, chat_template)], params)[0]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        """Yield a :class:`StepEvent` per denoising step of one prompt; the last has ``finished=True``."""
        params = params or SamplingParams()
        seq = self.make_sequences(self.encode(prompt), params, f"stream-{next(_ids)}")[0]
        sched = Scheduler(self.denoiser, max_batch_size=1)
        sched.waiting.append(seq)
        while sched.has_work():
            yield from sched.step()

    def output_of(self, seq: Sequence) -> RequestOutput:
        """RequestOutput of a single finished sequence."""
        return RequestOutput(seq.request_id, None, seq.prompt_ids, [seq.completion()],
                             seconds=(seq.finish_time or time.time()) - seq.created,
                             time_to_first_token=(seq.first_token_time - seq.created) if seq.first_token_time else None)
