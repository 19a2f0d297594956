"""The one engine loop: :class:`Engine` owns a :class:`~unmask.engine.scheduler.Scheduler` and a
:class:`~unmask.engine.denoiser.Denoiser` (docs/design.md#decoding, "Scheduling").

``LLM`` (offline), ``AsyncEngine`` (a thread for asyncio servers) and ``unmask generate`` are thin wrappers: they
add requests, call :meth:`Engine.step` and read the :class:`~unmask.engine.outputs.StepEvent` objects it returns.
Not thread-safe: one thread drives an engine (``AsyncEngine``'s engine thread).

Errors: :class:`~unmask.engine.limits.ParamError` (names the field; HTTP 400),
:class:`~unmask.engine.scheduler.QueueFull` (HTTP 429).
"""
from __future__ import annotations

from dataclasses import replace

from .denoiser import Denoiser
from .layout import build_layout
from .limits import DEFAULT_PREFILL_CHUNK, ParamError
from .model import LoadedModel
from .outputs import StepEvent
from .params import SamplingParams
from .plan import DecodingPlan, drafts_by_default, resolve
from .prefix_cache import PrefixCache, model_fingerprint
from .request import Request
from .scheduler import Scheduler
from .multi_block import MultiBlockSequence
from .sequence import Sequence
from .speculative import SpeculativeSequence
from .text_ids import suffix_ids

__all__ = ["Engine", "make_requests", "plan_request"]


def plan_request(model: LoadedModel, params: SamplingParams, default_drafts: str = "auto") -> DecodingPlan:
    """The one resolution of a request's plan: :func:`unmask.engine.plan.resolve` with the checkpoint's settings,
    the engine's draft policy and the model's device type (so that a request's defaults follow the device it runs
    on, docs/design.md#exactness-contracts-by-device-and-dtype). Raises ParamError as ``resolve``."""
    return resolve(params, model.dllm, default_drafts, model.device.type)


def make_requests(model: LoadedModel, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1,
                  default_drafts: str = "auto") -> list[Request]:
    """The choices of one request: ``n`` of them with seeds seed, seed+1, ... (docs/design.md#decisions), each
    decoded by the strategy its resolved plan (``unmask.engine.plan.resolve``) names.

    Raises:
        ParamError: ``n`` is not a positive integer, or a parameter this model cannot honour (names the field).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParamError("n", f"must be a positive integer, got {n!r}")
    plan = plan_request(model, params, default_drafts)
    kind = SpeculativeSequence if plan.speculative else MultiBlockSequence if plan.multi_block else Sequence
    return [kind(request_id, prompt_ids, plan.for_choice(i), model.dllm, model.tokenizer, model.max_context,
                 model.device, vocab_size=model.vocab_size, index=i) for i in range(n)]


class Engine:
    """Continuous batching over one model.

    Args:
        model: the loaded model.
        max_batch_size: most choices decoded together in one step.
        max_queue: most choices waiting for a batch slot (beyond it :meth:`add_request` raises ``QueueFull``).
        max_cached_tokens: KV budget in canvas tokens (see :class:`Scheduler`); ``None`` = unlimited.
        default_drafts: ``auto`` | ``on`` | ``off``: whether requests that get speculative decoding only from the
            checkpoint's default draft (``unmask.engine.plan.drafts_by_default``; auto = not on a CPU).
        compile: ``model.enable_compile()`` first. denoiser: share an existing denoiser (its forward counter).
        enable_prefix_caching: keep the committed KV of finished and running requests and reuse it for requests
            whose prompts start the same way (docs/design.md#prefix-reuse); never on bidirectional models.
        prefix_cache: share an existing store (``LLM`` keeps one across its calls); implies reuse.
        prefill_chunk: what a sequence's prompt rows forwarded per step before its first step may cost, in
            row-equivalents (chunked prefill, :class:`~unmask.engine.denoiser.Denoiser`; 0 = the whole prompt at
            once); ignored with ``denoiser``.

    Raises:
        ValueError: ``default_drafts`` is not a policy; ``compile`` on packed weights; a ``prefix_cache`` built for
            another model.
    """

    def __init__(self, model: LoadedModel, max_batch_size: int = 16, max_queue: int = 1 << 30,
                 max_cached_tokens: int | None = None, default_drafts: str = "auto", compile: bool = False,
                 denoiser: Denoiser | None = None, enable_prefix_caching: bool = True,
                 prefix_cache: PrefixCache | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        drafts_by_default(default_drafts, model.device.type)  # validates
        self.model = model
        self.default_drafts = default_drafts
        self.denoiser = denoiser or Denoiser(model, compile=compile, prefill_chunk=prefill_chunk)
        if prefix_cache is None and enable_prefix_caching and model.dllm.attention != "bidirectional":
            prefix_cache = PrefixCache(model)
        elif prefix_cache is not None and prefix_cache.fingerprint != model_fingerprint(model):
            raise ValueError("prefix_cache: the store was built for another model (checkpoint files, weight "
                             "format, dtype, device or adapter differ); its KV would be wrong here")
        self.prefix_cache = prefix_cache
        self.scheduler = Scheduler(self.denoiser, max_batch_size=max_batch_size, max_queue=max_queue,
                                   max_cached_tokens=max_cached_tokens, prefix_cache=prefix_cache)

    # ------------------------------------------------------------------ requests
    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1,
                     fit_max_tokens: bool = False) -> list[Request]:
        """Build (and check) the choices of one request without queueing them (any thread may call this).

        ``fit_max_tokens``: ``params.max_tokens`` is a default rather than the client's value: lower it to the
        largest that fits the model's context (docs/design.md#decisions: "lowered to the remaining context when
        unset") and the KV budget (:meth:`Scheduler.fit_max_tokens`).

        Raises:
            ParamError: invalid or unsatisfiable parameters (names the field).
        """
        prompt_ids = list(prompt_ids)
        if fit_max_tokens:
            m = self.scheduler.fit_max_tokens(len(prompt_ids), params.max_tokens, self._need(prompt_ids, params),
                                              self.model.max_context)
            params = replace(params, max_tokens=m, min_tokens=min(params.min_tokens, m))
        return make_requests(self.model, prompt_ids, params, request_id, n, self.default_drafts)

    def _need(self, prompt_ids: list[int], params: SamplingParams):
        """``need(m)``: cached tokens a request with ``max_tokens = m`` reserves (canvas length x lanes, from the
        layout alone); raises ParamError (``max_tokens``/``prompt``) when its canvas exceeds the context."""
        model = self.model
        plan = plan_request(model, replace(params, max_tokens=1, min_tokens=0), self.default_drafts)
        n_suffix = len(suffix_ids(params, model.tokenizer, model.dllm.mask_token_id))
        absolute = model.dllm.block_alignment == "absolute"

        def need(m: int) -> int:
            lay = build_layout(len(prompt_ids), m, n_suffix, plan.block_size, plan.window_size, absolute,
                               model.max_context)
            return lay.length * plan.lanes

        return need

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1,
                    fit_max_tokens: bool = False, group: str | None = None) -> list[Request]:
        """Build, check and queue one request (``n`` choices); returns its choices (engine-side state). ``group``:
        the unit of fair admission (default ``request_id``; the server passes one id for all prompts of a request).

        Raises:
            ParamError: as :meth:`make_request`, or the request alone exceeds the KV budget.
            QueueFull: the waiting queue is full.
        """
        reqs = self.make_request(prompt_ids, params, request_id, n, fit_max_tokens)
        for r in reqs:  # several prompts of one client request share their fair share (scheduler docstring)
            r.group = group or request_id
        self.scheduler.check_admission(reqs, len(self.scheduler.waiting))
        self.scheduler.enqueue(reqs)
        return reqs

    def enqueue(self, reqs: list[Request]) -> None:
        """Queue choices already built and admitted (``AsyncEngine`` checks admission at submit)."""
        self.scheduler.enqueue(reqs)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[StepEvent]:
        """Admit waiting choices, run one denoising step for the batch; returns the step's events."""
        return self.scheduler.step()

    def abort(self, request_id: str) -> list[StepEvent]:
        """Cancel every choice of ``request_id`` (waiting or running); returns their final events."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """True while any choice is waiting or running."""
        return self.scheduler.has_work()

    def prefix_cache_stats(self) -> dict:
        """``{"queries", "hits", "tokens", "evicted"}`` of the prefix cache (tokens; zeros without one)."""
        if self.prefix_cache is None:
            return {"queries": 0, "hits": 0, "tokens": 0, "evicted": 0}
        return self.prefix_cache.stats()

    @property
    def num_unfinished(self) -> int:
        """Choices waiting or running."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)
