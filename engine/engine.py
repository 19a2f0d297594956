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

from .config import OWN_FORWARD_FAMILIES
from .denoiser import Denoiser
from .encoder_prefix import EncoderPrefixStore
from .layout import build_layout
from .limits import MAX_SEED, ParamError
from .model import LoadedModel
from .options import EngineConfig, with_options
from .outputs import StepEvent
from .params import SamplingParams
from .plan import DecodingPlan, EngineDefaults, engine_defaults, resolve
from .prefix_cache import PrefixCache, model_fingerprint
from .request import Request
from .scheduler import MemoryReading, Scheduler
from .multi_block import MultiBlockSequence
from .refinement import RefinementSequence
from .sequence import Sequence
from .speculative import SpeculativeSequence
from .step_graphs import check_cuda_graphs
from .text_ids import suffix_ids
from .uniform_canvas import UniformCanvasSequence
from .uniform_options import UNIFORM_CANVAS_FAMILIES, describe_uniform_defaults

__all__ = ["Engine", "make_requests", "plan_request", "model_defaults"]


def model_defaults(model: LoadedModel, config: EngineConfig | None = None) -> EngineDefaults:
    """The decoding plan's defaults of ``model`` under the engine options ``config`` (default: every option at its
    default): :func:`unmask.engine.plan.engine_defaults` with the model's settings, context and device type.

    Raises:
        ValueError: an engine option the model does not allow (names it: ``block_size``, ``max_model_len``,
            ``default_drafts``, ``cuda_graphs`` off CUDA).
    """
    config = config or EngineConfig()
    check_cuda_graphs(config.cuda_graphs, model.device)
    return engine_defaults(model.dllm, model.max_context, model.device.type, config.default_drafts,
                           config.block_size, config.max_model_len)


def plan_request(model: LoadedModel, params: SamplingParams, defaults: EngineDefaults | None = None
                 ) -> DecodingPlan:
    """The one resolution of a request's plan: :func:`unmask.engine.plan.resolve` with the engine's defaults
    (:func:`model_defaults`: the checkpoint's settings, the engine options and the model's device type, so that a
    request's defaults follow the device it runs on, docs/design.md#exactness-contracts-by-device-and-dtype).
    Raises ParamError as ``resolve``."""
    return resolve(params, model.dllm, defaults=defaults if defaults is not None else model_defaults(model))


def make_requests(model: LoadedModel, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1,
                  defaults: EngineDefaults | None = None, plan: DecodingPlan | None = None) -> list[Request]:
    """The choices of one request: ``n`` of them with seeds seed, seed+1, ... (docs/design.md#decisions), each
    decoded by the strategy its resolved plan (``unmask.engine.plan.resolve``) names. ``defaults``: the engine's
    (:func:`model_defaults`); ``plan``: already resolved by :func:`plan_request` (``params`` is then unused).

    Raises:
        ParamError: ``n`` is not a positive integer, or a parameter this model cannot honour (names the field).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ParamError("n", f"must be a positive integer, got {n!r}")
    defaults = defaults if defaults is not None else model_defaults(model)
    plan = plan if plan is not None else plan_request(model, params, defaults)
    kind = (UniformCanvasSequence if plan.uniform is not None else SpeculativeSequence if plan.speculative
            else MultiBlockSequence if plan.multi_block else RefinementSequence if plan.refinement else Sequence)
    # one choice whose plan already carries its seed: the plan as it is (for_choice would rebuild and re-check it)
    same = n == 1 and plan.params.seed == plan.seed and 0 <= plan.seed <= MAX_SEED
    plans = [plan] if same else [plan.for_choice(i) for i in range(n)]
    return [kind(request_id, prompt_ids, plans[i], model.dllm, model.tokenizer, defaults.max_context,
                 model.device, vocab_size=model.vocab_size, index=i) for i in range(n)]


class Engine:
    """Continuous batching over one model.

    Args:
        model: the loaded model (its settings are read, never changed: the engine's own defaults are
            :attr:`defaults`).
        config: the engine options (:class:`~unmask.engine.options.EngineConfig`; its loading options are unused
            here: the model is loaded). ``**options``: single fields of it (``max_batch_size=8``), replacing
            ``config``'s: ``max_batch_size``, ``max_queue``, ``max_cached_tokens`` (KV budget in canvas tokens, see
            :class:`Scheduler`; None = unlimited), ``default_drafts`` (``unmask.engine.plan.drafts_by_default``),
            ``compile``, ``enable_prefix_caching`` (docs/design.md#prefix-reuse; never on bidirectional models),
            ``prefill_chunk`` (chunked prefill, :class:`~unmask.engine.denoiser.Denoiser`; ignored with
            ``denoiser``), ``block_size`` and ``max_model_len`` (the plan's inputs, :func:`model_defaults`).
        denoiser: share an existing denoiser (its forward counter).
        prefix_cache: share an existing store (``LLM`` keeps one across its calls); implies reuse.
        memory_reading: share the available memory's last reading (``LLM`` keeps one across its calls:
            :meth:`Scheduler.check_memory`).

    Raises:
        ValueError: an option out of range or one the model does not allow (names it); ``compile`` on packed
            weights; a ``prefix_cache`` built for another model.
        TypeError: an unknown option.
    """

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *, denoiser: Denoiser | None = None,
                 prefix_cache: PrefixCache | None = None, memory_reading: MemoryReading | None = None, **options):
        config = self.config = with_options(EngineConfig, config, options).validate()
        self.model = model
        model_defaults(model, config)  # validates default_drafts, block_size, max_model_len against the model
        self.default_drafts = config.default_drafts
        self.denoiser = denoiser or Denoiser(model, compile=config.compile, prefill_chunk=config.prefill_chunk,
                                             cuda_graphs=config.cuda_graphs)
        if prefix_cache is None and config.enable_prefix_caching and model.dllm.attention != "bidirectional":
            prefix_cache = PrefixCache(model)
        elif prefix_cache is not None and prefix_cache.fingerprint != model_fingerprint(model):
            raise ValueError("prefix_cache: the store was built for another model (checkpoint files, weight "
                             "format, dtype, device or adapter differ); its KV would be wrong here")
        self.prefix_cache = prefix_cache
        if (model.dllm.family in OWN_FORWARD_FAMILIES and config.enable_prefix_caching
                and self.denoiser.encoder_store is None):
            self.denoiser.encoder_store = EncoderPrefixStore()  # the encoder's KV reuse (docs/design.md#prefix-reuse)
        self.scheduler = Scheduler(self.denoiser, max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                   max_cached_tokens=config.max_cached_tokens, prefix_cache=prefix_cache,
                                   max_step_rows=config.max_step_rows,
                                   gpu_memory_utilization=config.gpu_memory_utilization,
                                   memory_reading=memory_reading)
        self.scheduler.kv_bytes_per_token, self.scheduler.logit_row_bytes = memory_sizes(model)

    @property
    def defaults(self) -> EngineDefaults:
        """What a request that sets nothing gets here (:func:`model_defaults`: the model's settings and device type
        under this engine's options; read-only)."""
        return model_defaults(self.model, self.config)

    @property
    def max_context(self) -> int:
        """The context in tokens: the model's, or the ``max_model_len`` option below it."""
        return self.defaults.max_context

    # ------------------------------------------------------------------ requests
    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1,
                     fit_max_tokens: bool = False, plan: DecodingPlan | None = None) -> list[Request]:
        """Build (and check) the choices of one request without queueing them (any thread may call this).

        ``fit_max_tokens``: ``params.max_tokens`` is a default rather than the client's value: lower it to the
        largest that fits the model's context (docs/design.md#decisions: "lowered to the remaining context when
        unset") and the KV budget (:meth:`Scheduler.fit_max_tokens`). ``plan``: ``params`` already resolved on this
        engine (:func:`plan_request`; a plan does not depend on the prompt), e.g. ``LLM.generate``'s prompts
        sharing one ``SamplingParams`` (:meth:`~unmask.engine.plan.DecodingPlan.with_new_seed` where it sets no
        seed).

        Raises:
            ParamError: invalid or unsatisfiable parameters (names the field).
        """
        prompt_ids = list(prompt_ids)
        defaults = self.defaults
        if plan is None:
            plan = plan_request(self.model, params, defaults)  # once: max_tokens changes no other choice
        if fit_max_tokens:
            m = self.scheduler.fit_max_tokens(len(prompt_ids), params.max_tokens,
                                              self._need(prompt_ids, plan, defaults.max_context), defaults.max_context,
                                              plan.lanes)
            p = plan.params
            plan = replace(plan, params=replace(p, max_tokens=m, min_tokens=min(p.min_tokens, m)))
        return make_requests(self.model, prompt_ids, plan.params, request_id, n, defaults, plan)

    def _need(self, prompt_ids: list[int], plan: DecodingPlan, max_context: int):
        """``need(m)``: cached tokens a request with ``max_tokens = m`` reserves (canvas length x lanes, from the
        layout alone); raises ParamError (``max_tokens``/``prompt``) when its canvas exceeds the context."""
        model = self.model
        n_suffix = len(suffix_ids(plan.params, model.tokenizer, model.dllm.mask_token_id))
        absolute = model.dllm.block_alignment == "absolute"

        def need(m: int) -> int:
            lay = build_layout(len(prompt_ids), m, n_suffix, plan.block_size, plan.window_size, absolute,
                               max_context)
            return lay.length * plan.lanes

        return need

    def describe_defaults(self) -> str:
        """The plan's one line of what a request that sets nothing gets here
        (:meth:`~unmask.engine.plan.EngineDefaults.describe`, with what drafts and verifies on this model)."""
        from pathlib import Path

        d, m = self.model.dllm, self.model
        if d.family in UNIFORM_CANVAS_FAMILIES:  # no masks, block or remasking (the new-user pass read them here)
            return describe_uniform_defaults(d.block_size, d.default_sampling)
        verifier = (str(Path(m.path) / Path(d.verifier).expanduser()) if d.verifier
                    else "the parent's causal path" if m.adapter else "the model's causal path")
        return self.defaults.describe(verifier, "the mask-row adapter" if m.adapter else "the model's mask rows")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str, n: int = 1,
                    fit_max_tokens: bool = False, group: str | None = None, plan: DecodingPlan | None = None
                    ) -> list[Request]:
        """Build, check and queue one request (``n`` choices); returns its choices (engine-side state). ``group``:
        the unit of fair admission (default ``request_id``; the server passes one id for all prompts of a request).
        ``plan``: as :meth:`make_request`.

        Raises:
            ParamError: as :meth:`make_request`, or the request alone exceeds the KV budget.
            QueueFull: the waiting queue is full.
        """
        reqs = self.make_request(prompt_ids, params, request_id, n, fit_max_tokens, plan)
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

    def score(self, prompt_ids: list[int], top_k: int = 0, samples: int | None = None, seed: int = 0):
        """The log-probabilities of ``prompt_ids`` (:func:`unmask.engine.scoring.score_prompt`: exact on a causal
        path, a Monte-Carlo estimate on a bidirectional model) as a :class:`~unmask.engine.scoring.PromptScores`."""
        from .scoring import score_prompt

        return score_prompt(self.model, prompt_ids, top_k, samples, seed)

    def has_unfinished(self) -> bool:
        """True while any choice is waiting or running."""
        return self.scheduler.has_work()

    def prefix_cache_stats(self) -> dict:
        """``{"queries", "hits", "tokens", "evicted"}`` of the prefix cache (tokens; zeros without one)."""
        if self.prefix_cache is None:
            store = self.denoiser.encoder_store
            return store.stats() if store is not None else {"queries": 0, "hits": 0, "tokens": 0, "evicted": 0}
        return self.prefix_cache.stats()

    @property
    def num_unfinished(self) -> int:
        """Choices waiting or running."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)


def memory_sizes(model: LoadedModel) -> tuple[int | None, int | None]:
    """``(bytes per cached token, bytes per float32 logits row)`` of ``model`` for the scheduler's memory estimate
    (docs/design.md#admission-and-limits); None where the config does not say (the check is then skipped)."""
    cfg = getattr(model.model, "config", None)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layers", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "n_kv_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "d_model", None)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return None, None
    return 2 * layers * kv_heads * head_dim * 4, 4 * model.vocab_size  # float32 at most: an upper bound
