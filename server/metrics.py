"""Prometheus metrics of one app (docs/design.md#decisions: vLLM's names with the ``unmask:`` prefix).

Every metric lives in the app's own ``CollectorRegistry``, so building the app twice in one process never raises
"Duplicated timeseries". Label ``model_name`` on all of them.

What moves when (values move exactly with the requests served):

* as a request runs, after every denoising step of each of its choices (docs/design.md#deployment-and-metrics):
  ``generation_tokens_total`` += the tokens the step added to the choice's revealed left-to-right prefix
  (``StepEvent.num_tokens``; the final prefix of a choice, up to and including its first EOS, is its
  ``completion_tokens``), ``nfe_total`` += its new forwards, ``denoising_steps_total`` += 1,
  ``spec_decode_num_draft_tokens_total`` / ``spec_decode_num_accepted_tokens_total`` += the drafts it verified /
  accepted (self-speculative requests; vLLM's names), and ``prompt_tokens_total`` += a prompt's tokens at the first
  forward of one of its choices; so ``rate(generation_tokens_total[1m])`` follows a long stream as it runs instead
  of jumping when it ends. When the request ends the counters are topped up to its final work
  (:class:`~unmask.server.accounting.Tally`), so over whole requests they equal the sums of the responses' usage;
* a request that completes (all its choices finished with ``stop``/``length``): the prompt tokens of any prompt
  not counted yet, ``request_success_total{finished_reason}`` += 1 per choice, one
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds`` and ``time_to_first_token_seconds`` observation
  per request, one ``tokens_per_forward`` observation per choice (generated tokens / NFE), one ``steps_per_block``
  observation per decoded block (none for self-speculative requests: they reveal left to right with no denoising
  blocks; their steps are in ``denoising_steps``);
* a request refused at admission (queue or cache full) or failing after it (client disconnect, timeout, engine fault):
  ``request_failure_total{reason}`` += 1 with reason ``abort`` | ``timeout`` | ``error`` | ``queue_full`` |
  ``cache_full``; the work it got before it ended stays counted (the revealed prefix an aborted request keeps, its
  forwards, steps and drafts, and the prompts that ran at least one forward), so
  ``rate(generation_tokens_total)`` is the work done, cancelled streams included; 4xx validation errors count
  nothing there (they are ``request_refused_total``);
* ``num_requests_running`` / ``num_requests_waiting`` read the engine's counters at scrape time, and so do the
  counters ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (vLLM's names: prompt tokens looked up in
  / loaded from the prefix cache, docs/design.md#prefix-reuse; hit rate = hits / queries);
* ``kv_cache_usage_perc`` (vLLM's name): at scrape time, the cached tokens the running and paused sequences reserve
  / the scheduler's KV budget (``--max-cached-tokens``; without one the most the batch can reserve, max batch size
  x the context), at most 1; ``prefix_cache_usage_perc``: the prefix store's tokens / the same budget;
* every 4xx answer with an error body (the guard's 401/413/415/400s, validation 400s, 404, 405, 429):
  ``request_refused_total{status, reason}`` += 1, ``reason`` the error's ``code``;
* a streamed choice's content chunk after its first: one ``inter_token_latency_seconds{tokens_per_chunk}``
  observation, the seconds since its previous content chunk, labelled by the tokens this one carries (1, 2, 3-4,
  5-8, 9-16, 17+; a diffusion step may reveal several).

Tokens/s for a dashboard: ``rate(unmask:generation_tokens_total[1m])``.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from .accounting import Work

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TPF_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
STEPS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 512)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
#: the ``tokens_per_chunk`` label of the inter-token latency: tokens a content chunk carries, in these ranges
TOKENS_PER_CHUNK = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"), (None, "17+"))
#: refusals exported from the start (0): the common (status, reason) pairs; others appear when they happen
COMMON_REFUSALS = (("400", "invalid_value"), ("400", "unknown_field"), ("400", "unsupported_field"),
                   ("400", "invalid_json"), ("401", "invalid_api_key"), ("404", "model_not_found"),
                   ("404", "not_found"), ("413", "request_too_large"), ("415", "unsupported_media_type"),
                   ("429", "queue_full"))


def tokens_label(tokens: int) -> str:
    """The ``tokens_per_chunk`` label of a chunk that carries ``tokens`` tokens (at least 1)."""
    return next(label for top, label in TOKENS_PER_CHUNK if top is None or max(1, tokens) <= top)


def _share(part: str, engine) -> float:
    """``engine.kv_usage()[part]`` / its capacity, at most 1 (0 without an engine that reports it)."""
    usage = engine.kv_usage() if hasattr(engine, "kv_usage") else None
    return min(1.0, usage[part] / usage["capacity"]) if usage and usage["capacity"] else 0.0


class PrefixCacheCounters:
    """A collector of the engine's prefix-cache counters (tokens), read at scrape time: the engine thread owns
    them, a ``Counter`` here would be a copy. ``engine``: has ``prefix_cache_queries`` / ``prefix_cache_hits``."""

    def __init__(self, model_name: str, engine):
        self.model_name, self.engine = model_name, engine

    def collect(self):
        for name, doc, attr in (("unmask:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                 "prefix_cache_queries"),
                                ("unmask:prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.",
                                 "prefix_cache_hits")):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(self.engine, attr, 0) or 0))
            yield family


def engine_metrics(registry: CollectorRegistry, model_name: str, engine) -> None:
    """Register the metrics read from ``engine`` at scrape time in ``registry``: ``num_requests_running`` /
    ``num_requests_waiting`` (its ``num_running`` / ``num_waiting``), the prefix-cache counters, and the KV-cache
    usage gauges (its ``kv_usage()``; 0 without one). The gauges a cluster scheduler reads per model server (llm-d:
    queued requests, KV-cache usage; docs/design.md#deployment-and-metrics) are here, so an engine replica without
    the HTTP app (Ray Serve, docs/design.md#scale-out) exports them the same way."""
    L = ["model_name"]
    running = Gauge("unmask:num_requests_running", "Requests with a sequence in the running batch.", L,
                    registry=registry)
    waiting = Gauge("unmask:num_requests_waiting", "Requests waiting for a batch slot.", L, registry=registry)
    running.labels(model_name).set_function(lambda: engine.num_running)
    waiting.labels(model_name).set_function(lambda: engine.num_waiting)
    registry.register(PrefixCacheCounters(model_name, engine))
    kv_usage = Gauge("unmask:kv_cache_usage_perc", "Fraction of the scheduler's KV budget reserved by the running "
                     "and paused sequences (--max-cached-tokens; without one, max batch size x context), as vLLM's "
                     "kv_cache_usage_perc; 1 = full.", L, registry=registry)
    prefix_usage = Gauge("unmask:prefix_cache_usage_perc", "Fraction of the same KV budget held by the prefix store "
                         "(reusable prompt prefixes, evicted first).", L, registry=registry)
    kv_usage.labels(model_name).set_function(lambda: _share("reserved", engine))
    prefix_usage.labels(model_name).set_function(lambda: _share("prefix", engine))


class Metrics:
    """The app's metrics.

    Args:
        model_name: value of the ``model_name`` label.
        engine: object with ``num_running`` / ``num_waiting`` attributes (the gauges read them at scrape time), or
            one whose ``exports_engine_metrics`` is False (Ray Serve's ingress: every engine replica exports its own
            gauges, :func:`engine_metrics`; the ingress's would count each request twice in a dashboard's sums).
    """

    def __init__(self, model_name: str, engine=None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, L = self.registry, ["model_name"]
        self.prompt_tokens = Counter("unmask:prompt_tokens", "Prompt tokens of requests that ran (completed or not).",
                                     L, registry=r)
        self.generation_tokens = Counter("unmask:generation_tokens",
                                         "Generated tokens (up to and including the first EOS), counted as "
                                         "each denoising step reveals them (completed and cancelled requests).",
                                         L, registry=r)
        self.request_success = Counter("unmask:request_success", "Finished choices by finish reason.",
                                       L + ["finished_reason"], registry=r)
        self.request_failure = Counter("unmask:request_failure", "Requests refused at admission (queue_full, cache_full) or failed after it (abort, timeout, error), by reason.",
                                       L + ["reason"], registry=r)
        self.nfe = Counter("unmask:nfe", "Model forward evaluations per request (CFG counts twice), completed or not.",
                           L, registry=r)
        self.denoising_steps = Counter("unmask:denoising_steps", "Denoising steps of requests, completed or not.",
                                       L, registry=r)
        self.ttft = Histogram("unmask:time_to_first_token_seconds",
                              "Seconds from request arrival to the first final content character.", L,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("unmask:e2e_request_latency_seconds", "Seconds from request arrival to its end.", L,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("unmask:request_queue_time_seconds",
                                    "Seconds a request waited before its first denoising step.", L,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.tpf = Histogram("unmask:tokens_per_forward", "Generated tokens per model forward, per choice.", L,
                             buckets=TPF_BUCKETS, registry=r)
        self.steps_per_block = Histogram("unmask:steps_per_block", "Denoising steps each decoded block took.", L,
                                         buckets=STEPS_BUCKETS, registry=r)
        self.drafts = Counter("unmask:spec_decode_num_draft_tokens",
                              "Draft tokens verified by self-speculative decoding.", L, registry=r)
        self.accepted = Counter("unmask:spec_decode_num_accepted_tokens",
                                "Draft tokens accepted by self-speculative decoding (acceptance rate = "
                                "accepted / draft).", L, registry=r)
        if engine is not None and getattr(engine, "exports_engine_metrics", True):
            engine_metrics(r, model_name, engine)
        self._serving_metrics()
        for metric in (self.prompt_tokens, self.generation_tokens, self.nfe, self.denoising_steps, self.ttft,
                       self.e2e, self.queue_time, self.tpf, self.steps_per_block, self.drafts, self.accepted):
            metric.labels(model_name)  # exported from the start (0), not only after the first request
        for reason in ("abort", "timeout", "error", "queue_full", "cache_full"):
            self.request_failure.labels(model_name, reason)
        for reason in ("stop", "length"):
            self.request_success.labels(model_name, reason)
        # the labelled children the per-step counting increments
        self._prompt = self.prompt_tokens.labels(model_name)
        self._generation = self.generation_tokens.labels(model_name)
        self._nfe = self.nfe.labels(model_name)
        self._steps = self.denoising_steps.labels(model_name)
        self._drafts = self.drafts.labels(model_name)
        self._accepted = self.accepted.labels(model_name)

    def _serving_metrics(self) -> None:
        """4xx refusals by reason and the inter-token latency of streams."""
        r, L, m = self.registry, ["model_name"], self.model_name
        self.refused = Counter("unmask:request_refused", "Requests answered with a 4xx error body, by status and "
                               "reason (the error's code: invalid_value, unknown_field, invalid_api_key, queue_full, "
                               "...).", L + ["status", "reason"], registry=r)
        for status, reason in COMMON_REFUSALS:
            self.refused.labels(m, status, reason)
        self.itl = Histogram("unmask:inter_token_latency_seconds", "Seconds between two content chunks of one "
                             "streamed choice, by the tokens the later chunk carries.", L + ["tokens_per_chunk"],
                             buckets=ITL_BUCKETS, registry=r)
        for _, label in TOKENS_PER_CHUNK:
            self.itl.labels(m, label)

    def record_refusal(self, status: int, code: str | None) -> None:
        """Count one 4xx answer (``code``: the error body's, e.g. ``invalid_value``); other statuses count nothing."""
        if 400 <= status < 500:
            self.refused.labels(self.model_name, str(status), code or "none").inc()

    def observe_itl(self, seconds: float, tokens: int) -> None:
        """One inter-token latency: ``seconds`` since the choice's previous content chunk, ``tokens`` in this one."""
        self.itl.labels(self.model_name, tokens_label(tokens)).observe(max(0.0, seconds))

    def count_work(self, prompt_tokens: int, work) -> None:
        """Add work done since the last count: ``prompt_tokens`` newly processed prompt tokens and ``work`` (a
        :class:`~unmask.server.accounting.Work` of non-negative increments: tokens, NFE, steps, drafts)."""
        if prompt_tokens:
            self._prompt.inc(prompt_tokens)
        if work.tokens:
            self._generation.inc(work.tokens)
        if work.nfe:
            self._nfe.inc(work.nfe)
        if work.steps:
            self._steps.inc(work.steps)
        if work.drafts_proposed:
            self._drafts.inc(work.drafts_proposed)
        if work.drafts_accepted:
            self._accepted.inc(work.drafts_accepted)

    def record_success(self, outputs, arrival: float, end: float, first_token: float | None,
                       queue_time: float | None) -> None:
        """Observe one completed request (its work is counted by :meth:`count_work`). ``outputs``: the
        :class:`CompletionOutput` of each of its choices (all prompts); times are ``time.time()`` seconds."""
        m = self.model_name
        for o in outputs:
            self.request_success.labels(m, o.finish_reason).inc()
            if o.nfe:
                self.tpf.labels(m).observe(len(o.token_ids) / o.nfe)
            for steps in o.steps_per_block:
                self.steps_per_block.labels(m).observe(steps)
        self.e2e.labels(m).observe(max(0.0, end - arrival))
        if queue_time is not None:
            self.queue_time.labels(m).observe(queue_time)
        if first_token is not None:
            self.ttft.labels(m).observe(max(0.0, first_token - arrival))

    def record_failure(self, reason: str, prompts=()) -> None:
        """Count one request that failed after admission (``abort`` | ``timeout`` | ``error`` | ...). ``prompts``:
        work not counted yet, ``(prompt_tokens, work)`` per prompt, ``work`` one
        :class:`~unmask.server.accounting.Work` per choice (its tokens, NFE, steps and drafts); the prompt's tokens
        count when one of its choices ran at least one forward. A request whose events were read passes none: the
        :class:`~unmask.server.accounting.Tally` counted its work as it ran."""
        self.request_failure.labels(self.model_name, reason).inc()
        for prompt_tokens, work in prompts:
            nfe = sum(w.nfe for w in work)
            for w in work:
                self.count_work(0, w)
            if nfe:
                self.count_work(prompt_tokens, Work())

    def render(self) -> tuple[bytes, str]:
        """Exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
