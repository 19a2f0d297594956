"""Prometheus metrics of one app (docs/design.md section 10: vLLM's names with the ``unmask:`` prefix).

Every metric lives in the app's own ``CollectorRegistry``, so building the app twice in one process never raises
"Duplicated timeseries". Label ``model_name`` on all of them.

What moves when (values move exactly with the requests served):

* a request that completes (all its choices finished with ``stop``/``length``): ``prompt_tokens_total`` += its
  usage ``prompt_tokens``, ``generation_tokens_total`` += ``completion_tokens``, ``nfe_total`` += usage ``nfe``,
  ``denoising_steps_total`` += usage ``denoising_steps``, ``request_success_total{finished_reason}`` += 1 per choice,
  one ``e2e_request_latency_seconds``, ``request_queue_time_seconds`` and ``time_to_first_token_seconds``
  observation per request, one ``tokens_per_forward`` observation per choice (generated tokens / NFE), one
  ``steps_per_block`` observation per decoded block (none for self-speculative requests: they reveal left to right
  with no denoising blocks; their steps are in ``denoising_steps``), and (self-speculative requests; vLLM's names)
  ``spec_decode_num_draft_tokens_total`` / ``spec_decode_num_accepted_tokens_total`` += the drafts verified / accepted;
* a request that fails after admission (client disconnect, timeout, engine fault, queue/cache full):
  ``request_failure_total{reason}`` += 1 with reason ``abort`` | ``timeout`` | ``error`` | ``queue_full`` |
  ``cache_full``, and the work it got before it ended is still counted (vLLM counts tokens as they are generated;
  here they are counted when the request ends): ``generation_tokens_total`` += the tokens it had revealed (the
  left-to-right prefix an aborted request keeps, ``StepEvent.num_tokens``), ``nfe_total`` and
  ``denoising_steps_total`` += its forwards and steps, ``prompt_tokens_total`` += each of its prompts that ran at
  least one forward (so ``rate(generation_tokens_total)`` is the work done, cancelled streams included), and the
  drafts it verified / accepted; 4xx
  validation errors count nothing;
* ``num_requests_running`` / ``num_requests_waiting`` read the engine's counters at scrape time.

Tokens/s for a dashboard: ``rate(unmask:generation_tokens_total[1m])``.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TPF_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
STEPS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256, 512)


class Metrics:
    """The app's metrics.

    Args:
        model_name: value of the ``model_name`` label.
        engine: object with ``num_running`` / ``num_waiting`` attributes (the gauges read them at scrape time).
    """

    def __init__(self, model_name: str, engine=None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, L = self.registry, ["model_name"]
        self.prompt_tokens = Counter("unmask:prompt_tokens", "Prompt tokens of requests that ran (completed or not).",
                                     L, registry=r)
        self.generation_tokens = Counter("unmask:generation_tokens",
                                         "Generated tokens (up to and including the first EOS) of completed and "
                                         "cancelled requests.", L, registry=r)
        self.request_success = Counter("unmask:request_success", "Finished choices by finish reason.",
                                       L + ["finished_reason"], registry=r)
        self.request_failure = Counter("unmask:request_failure", "Requests that failed after admission, by reason.",
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
        self.running = Gauge("unmask:num_requests_running", "Requests with a sequence in the running batch.", L,
                             registry=r)
        self.waiting = Gauge("unmask:num_requests_waiting", "Requests waiting for a batch slot.", L, registry=r)
        if engine is not None:
            self.running.labels(model_name).set_function(lambda: engine.num_running)
            self.waiting.labels(model_name).set_function(lambda: engine.num_waiting)
        for metric in (self.prompt_tokens, self.generation_tokens, self.nfe, self.denoising_steps, self.ttft,
                       self.e2e, self.queue_time, self.tpf, self.steps_per_block, self.drafts, self.accepted):
            metric.labels(model_name)  # exported from the start (0), not only after the first request
        for reason in ("abort", "timeout", "error", "queue_full", "cache_full"):
            self.request_failure.labels(model_name, reason)
        for reason in ("stop", "length"):
            self.request_success.labels(model_name, reason)

    def record_success(self, prompt_tokens: int, outputs, arrival: float, end: float, first_token: float | None,
                       queue_time: float | None) -> None:
        """Count one completed request. ``outputs``: the :class:`CompletionOutput` of each of its choices (all
        prompts); times are ``time.time()`` seconds."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(sum(len(o.token_ids) for o in outputs))
        self.nfe.labels(m).inc(sum(o.nfe for o in outputs))
        self.denoising_steps.labels(m).inc(sum(o.steps for o in outputs))
        self._count_drafts(outputs)
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
        """Count one request that failed after admission (``abort`` | ``timeout`` | ``error`` | ...), and the work
        it did before it ended. ``prompts``: ``(prompt_tokens, work)`` per prompt of the request, ``work`` one
        :class:`~unmask.server.accounting.Work` per choice: its tokens (the revealed prefix), NFE, steps and drafts,
        and the prompt's tokens when one of its choices ran at least one forward."""
        m = self.model_name
        self.request_failure.labels(m, reason).inc()
        for prompt_tokens, work in prompts:
            nfe = sum(w.nfe for w in work)
            if nfe:
                self.prompt_tokens.labels(m).inc(prompt_tokens)
                self.nfe.labels(m).inc(nfe)
            self.generation_tokens.labels(m).inc(sum(w.tokens for w in work))
            self.denoising_steps.labels(m).inc(sum(w.steps for w in work))
            self._count_drafts(work)

    def _count_drafts(self, items) -> None:
        """Add the drafts verified and accepted (0 for choices not decoded self-speculatively); ``items``: outputs
        or :class:`~unmask.server.accounting.Work`, both with ``drafts_proposed`` / ``drafts_accepted``."""
        self.drafts.labels(self.model_name).inc(sum(i.drafts_proposed for i in items))
        self.accepted.labels(self.model_name).inc(sum(i.drafts_accepted for i in items))

    def render(self) -> tuple[bytes, str]:
        """Exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
