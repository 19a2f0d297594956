"""Offline Python API in vLLM's style: ``LLM(model).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from .denoiser import Denoiser
from .model import LoadedModel, load_model
from .engine import Engine, make_requests, model_defaults
from .options import EngineConfig, with_options
from .outputs import CompletionOutput, RequestOutput, StepEvent
from .limits import ParamError
from .params import SamplingParams
from .plan import DecodingPlan
from .prefix_cache import PrefixCache
from .config import OWN_FORWARD_FAMILIES
from .encoder_prefix import EncoderPrefixStore
from .request import Request
from .scheduler import MemoryReading
from .text_ids import encode_text

_ids = itertools.count()


def encode_prompt(tokenizer, prompt: str | list[int], mask_token_id: int | None = None) -> list[int]:
    """Token ids of a prompt: a string is tokenised with the tokenizer's special tokens (e.g. BOS), the mask
    token's text in it as plain text (:func:`~unmask.engine.text_ids.encode_text`); a list of ids is returned as a
    copy (the engine refuses one holding ``mask_token_id``)."""
    if isinstance(prompt, list):
        return list(prompt)
    return encode_text(tokenizer, prompt, mask_token_id)


def chat_prompt_ids(tokenizer, messages: list[dict], chat_template: str | None = None,
                    mask_token_id: int | None = None) -> list[int]:
    """Token ids of a chat (``[{"role", "content"}, ...]``) rendered by the model's chat template (or
    ``chat_template``, a Jinja string) with the generation prompt; the rendered text is tokenised without adding
    special tokens again (the template writes them), the mask token's text as plain text.

    Raises:
        ParamError: (field ``messages``) the tokenizer has no chat template and none was given.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ParamError("messages", "this model has no chat template; pass --chat-template or use completions")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template)
    return encode_text(tokenizer, text, mask_token_id, add_special_tokens=False)


def make_sequences(model: LoadedModel, prompt_ids: list[int], params: SamplingParams, request_id: str,
                   n: int = 1, choice_ids: bool = False, config: EngineConfig | None = None) -> list[Request]:
    """Compatibility alias of :func:`unmask.engine.engine.make_requests` (``choice_ids`` is ignored: every choice
    carries ``request_id`` and its ``index``) under the engine options ``config``."""
    return make_requests(model, prompt_ids, params, request_id, n, model_defaults(model, config))


#: the queue of ``LLM``'s own engines: unbounded, since ``generate_iter`` reads requests ahead by its own bound
UNBOUNDED_QUEUE = 1 << 30


class LLM:
    """A diffusion LM with continuous batching, for scripts and tests.

    Args:
        model: checkpoint directory / hub id, or an already :class:`LoadedModel`.
        config: the engine options (:class:`~unmask.engine.options.EngineConfig`: loading ones such as ``family``,
            ``device``, ``dtype``, ``weights``, ``adapter``, ``parent`` for a path only; ``max_batch_size``,
            ``compile``, ``default_drafts``, ``enable_prefix_caching`` (one prefix store across calls, so that a
            chat's next turn reuses the last one's KV, docs/design.md#prefix-reuse), ``prefill_chunk``,
            ``block_size``, ``max_model_len``, ...). ``**options``: single fields of it, replacing ``config``'s
            (``LLM(dir, adapter=..., max_batch_size=8)``). Each call runs its own engine (no other call's; one
            that a finished call left idle is taken again) with an unbounded queue.

    Raises:
        ValueError: an option out of range or one the model does not allow (names it). TypeError: an unknown
            option.

    Example::

        llm = LLM("runs/smollm2-a2d")
        out = llm.generate("Name three colours.", SamplingParams(max_tokens=32, temperature=0))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | LoadedModel, config: EngineConfig | None = None, **options):
        config = self.config = with_options(EngineConfig, config, options).validate()
        self.model = model if isinstance(model, LoadedModel) else load_model(model, **config.load_options())
        self.denoiser = Denoiser(self.model, compile=config.compile, prefill_chunk=config.prefill_chunk,
                                 cuda_graphs=config.cuda_graphs)
        self.max_batch_size = config.max_batch_size
        self.default_drafts = config.default_drafts
        # one store across calls, so that a chat's next turn reuses the last one's KV (docs/design.md#prefix-reuse)
        self.prefix_cache = (PrefixCache(self.model) if config.enable_prefix_caching
                             and self.model.dllm.attention != "bidirectional" else None)
        if config.enable_prefix_caching and self.model.dllm.family in OWN_FORWARD_FAMILIES:  # the encoder's KV
            self.denoiser.encoder_store = EncoderPrefixStore()
        self.memory_reading = MemoryReading()  # one reading of the available memory across calls (admission)
        self._idle: dict[int, Engine] = {}  # max_batch_size -> the engine of a call that ended with nothing left
        self._engine(1)  # validates the plan's inputs against the model

    def _engine(self, max_batch_size: int) -> Engine:
        """A fresh engine loop over this model (one per call: calls never share a batch), sharing the denoiser."""
        return Engine(self.model, self.config, denoiser=self.denoiser, prefix_cache=self.prefix_cache,
                      max_batch_size=max_batch_size, max_queue=UNBOUNDED_QUEUE, enable_prefix_caching=False,
                      max_step_rows=None,  # one caller's offline batch: no other client to be fair to
                      memory_reading=self.memory_reading)

    def _call_engine(self, max_batch_size: int) -> Engine:
        """The engine of one ``generate_iter`` call: the last call's when that call ended with no choice waiting or
        running (an engine is never held by two calls: it is taken here and put back only by a call that ran to
        its end), else a fresh one (:meth:`_engine`). An idle engine is a fresh one's equal: its batch, queue and
        paused set are empty; what engines share (denoiser, KV pool, prefix store, memory reading) is shared by
        fresh ones too (issue 42: building an engine per call cost as much as a batch-1 call's other host work)."""
        engine = self._idle.pop(max_batch_size, None)
        if engine is None or engine.has_unfinished():
            engine = self._engine(max_batch_size)
        return engine

    @property
    def tokenizer(self):
        """The loaded model's Hugging Face tokenizer."""
        return self.model.tokenizer

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (see :func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, self.model.dllm.mask_token_id)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None) -> list[int]:
        """Token ids of a chat rendered with the generation prompt (see :func:`chat_prompt_ids`)."""
        return chat_prompt_ids(self.tokenizer, messages, chat_template, self.model.dllm.mask_token_id)

    def make_sequences(self, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1
                       ) -> list[Request]:
        """The choices of one request, not queued (see :func:`unmask.engine.engine.make_requests`)."""
        return make_requests(self.model, prompt_ids, params, request_id, n, model_defaults(self.model, self.config))

    def score(self, prompt: str | list[int], top_k: int = 0, samples: int | None = None, seed: int = 0):
        """The log-probabilities of a prompt's tokens (:func:`unmask.engine.scoring.score_prompt`: exact on a causal
        path, a Monte-Carlo estimate from ``samples`` draws seeded by ``seed`` on a bidirectional model)."""
        from .scoring import score_prompt

        return score_prompt(self.model, self.encode(prompt), top_k, samples, seed)

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
        for i, out in self.generate_iter(((p, params) for p in prompts), n=n, lookahead=len(prompts),
                                         _one_params=True):
            outputs[i] = out
        return outputs

    def generate_iter(self, requests, n: int = 1, lookahead: int | None = None, *, _one_params: bool = False
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

        ``_one_params`` (``generate``'s): every request carries the same ``SamplingParams``, which nothing changes
        meanwhile, so it is resolved once (a plan does not depend on the prompt; each request still draws its own
        seed when the parameters set none: ``DecodingPlan.with_new_seed``).
        """
        engine = self._call_engine(self.max_batch_size)
        ahead = self.max_batch_size if lookahead is None else max(1, lookahead)
        pending: dict[str, tuple[int, RequestOutput, list, float]] = {}
        source = enumerate(requests)
        exhausted = False
        resolved: tuple[SamplingParams, DecodingPlan] | None = None  # _one_params: (params, its plan)
        while True:
            while not exhausted and engine.num_unfinished < self.max_batch_size + ahead * n:
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                    break
                i, (prompt, params) = nxt
                params = params or SamplingParams()
                rid = f"gen-{next(_ids)}"
                ids = self.encode(prompt)
                plan = None
                if resolved is not None and resolved[0] is params:
                    plan = resolved[1] if params.seed is not None else resolved[1].with_new_seed()
                reqs = engine.add_request(ids, params, rid, n, plan=plan)
                for r in reqs:
                    r.final_only = True  # only the finished events are read (below)
                if _one_params and resolved is None:
                    resolved = (params, reqs[0].plan)  # choice 0's plan: the request's (seed + 0)
                pending[rid] = (i, RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids), [None] * n,
                                time.time())
            if not engine.has_unfinished():
                self._idle[engine.scheduler.max_batch_size] = engine  # the next call may take it
                return
            for ev in engine.step():
                if not ev.finished:
                    continue
                i, out, outs, t0 = pending[ev.request_id]
                outs[ev.index] = ev.output
                if all(o is not None for o in outs):
                    del pending[ev.request_id]
                    yield i, _request_output(out, outs, t0)

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             chat_template: str | None = None) -> RequestOutput:
        """Generate one answer to a chat (``[{"role", "content"}, ...]``)."""
        return self.generate([self.apply_chat_template(messages, chat_template)], params)[0]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StepEvent]:
        """Yield a :class:`StepEvent` per denoising step of one prompt; the last has ``finished=True`` and the
        :class:`~unmask.engine.outputs.CompletionOutput` in ``output``.

        Raises:
            ParamError: invalid parameters for this model (names the field), at the first ``next``.
        """
        engine = self._engine(1)
        engine.add_request(self.encode(prompt), params or SamplingParams(), request_id or f"stream-{next(_ids)}")
        while engine.has_unfinished():
            yield from engine.step()


def _request_output(out: RequestOutput, outs: list[CompletionOutput], t0: float) -> RequestOutput:
    """``out`` with its choices and timing (``seconds`` from ``t0`` to the last finish; the first shown text)."""
    out.outputs = list(outs)
    out.seconds = max((o.finish_time or time.time()) for o in outs) - t0
    firsts = [o.first_token_time for o in outs if o.first_token_time]
    out.time_to_first_token = (min(firsts) - t0) if firsts else None
    return out
