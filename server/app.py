"""The FastAPI app: OpenAI-compatible routes over an :class:`~unmask.engine.AsyncEngine`.

``build_app(engine, model_name, ...)`` returns a new app each call (own Prometheus registry, own state), so tests
and embedders can build several in one process. Routes (docs/design.md#http-contract):

* ``GET /v1/models``, ``GET /v1/models/{id}`` (404 for an unknown id)
* ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE with ``stream: true``)
* ``GET /health`` (engine counters; 503 when the engine is down), ``GET /metrics`` (Prometheus text, no redirect)
* ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` (vLLM's shapes: :mod:`.tokenize_api`)

The server depends on the engine's public API only (``unmask.engine`` and ``unmask.engine.limits``; never on
``unmask.training``), and reads only the engine's outputs (step events, completion outputs, the request stream's
resolved plan).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field

import anyio
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from unmask.engine import AsyncEngine, TokenTexts, with_options
from unmask.engine.limits import DEFAULT_MAX_SEQS_PER_REQUEST, prompt_chars_limit

from . import prompt_scores
from . import protocol as P
from . import responses as R
from .accounting import finished_work
from .config import ServerConfig
from .disconnect import collect
from .errors import APIError, check_model, from_exception, install_handlers
from .body_limits import STRUCTURE_LIMITS, BodyLimitsMiddleware
from .guard import GuardMiddleware, cache_salt, needs_key
from .send_buffer import bounded, stream_response
from .metrics import Metrics
from .prompt_input import chat_ids, completion_ids, longest_token_chars
from .render import Render, echo_texts
from .request_id import RequestIdMiddleware
from .run import Run
from .sse import sse_events
from .tool_parsers import parser_factory
from .visualizer import mount_visualizer

log = logging.getLogger("unmask.server")

SHUTDOWN_GRACE_SECONDS = 3.0  # open streams get an error event + [DONE] before the connection closes
_ERRORS = {code: {"model": R.ErrorResponse} for code in (400, 401, 404, 413, 415, 429, 503)}


@dataclass
class ServerState:
    """What the routes share: the engine, the served name and the server's options (``config``; its limits also
    as attributes)."""

    engine: AsyncEngine
    model_name: str
    metrics: Metrics
    config: ServerConfig = field(default_factory=ServerConfig)
    #: ``config.max_seqs_per_request``, lowered to the engine's queue
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    #: the option that set ``max_seqs_per_request``: ``--max-queue`` where the queue is the smaller bound
    max_seqs_option: str = "--max-seqs-per-request"
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def default_max_tokens(self) -> int:
        return self.config.default_max_tokens

    @property
    def request_timeout(self) -> float | None:
        return self.config.request_timeout

    @property
    def chat_template(self) -> str | None:
        return self.config.chat_template

    @property
    def default_cache(self) -> str:
        return self.config.cache

    @property
    def tool_call_parser(self) -> str:
        return self.config.tool_call_parser

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer
        self.token_text = TokenTexts(self.tokenizer)
        self.max_context = self.engine.max_context
        # a text longer than this surely exceeds the context: refused before tokenizing
        # (docs/design.md#admission-and-limits)
        self.max_prompt_chars = prompt_chars_limit(self.max_context, longest_token_chars(self.tokenizer))
        # set when the server starts shutting down (SIGTERM/SIGINT); made per serving loop at start-up (an
        # asyncio.Event belongs to the first loop that waits on it)
        self.shutdown: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def serving(self) -> None:
        """Start-up on the running loop: a fresh shutdown event bound to it."""
        self.loop = asyncio.get_running_loop()
        self.shutdown = asyncio.Event()

    def shutdown_event(self) -> asyncio.Event | None:
        """The shutdown event when called on the serving loop, else ``None`` (e.g. a test client's own loop)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self.shutdown if running is self.loop else None

    def begin_shutdown(self) -> None:
        """Mark the server as shutting down: in-flight non-streamed requests are answered with a JSON 503
        ``server_shutdown`` at once (their engine requests aborted) instead of running into uvicorn's graceful-
        shutdown timeout and a plain-text 500. Safe from a signal handler or another thread."""
        loop, event = self.loop, self.shutdown
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)


#: build_app's keyword spellings that name a ServerConfig field otherwise
ALIASES = {"default_cache": "cache"}


def build_app(engine: AsyncEngine, model_name: str, config: ServerConfig | None = None, *,
              shutdown_engine: bool = True, **options) -> FastAPI:
    """Create the OpenAI-compatible app.

    Args:
        engine: the running engine (its model's tokenizer, vocabulary and context are used for validation).
        model_name: the id clients send as ``model`` and that ``/v1/models`` lists.
        config: the server's options (:class:`~unmask.server.config.ServerConfig`: ``api_key`` (``/v1/*`` then
            requires ``Authorization: Bearer <api_key>``, else 401), ``default_max_tokens`` (lowered to the remaining
            context), ``request_timeout`` (503 / a stream error event after it), ``chat_template`` (a Jinja
            template overriding the tokenizer's), ``cors_origins``, ``max_body_bytes`` (413 beyond), ``cache`` (the
            KV-cache policy of requests that send none), ``max_seqs_per_request`` (400 naming ``n`` beyond; lowered
            to the engine's queue, docs/design.md#admission-and-limits), ``tool_call_parser``). ``**options``:
            single fields of it, replacing ``config``'s (``default_cache`` is ``cache``).
        shutdown_engine: stop the engine thread when the app's lifespan ends.

    Raises:
        ValueError: an option out of range or an unknown ``tool_call_parser`` (names it). TypeError: an unknown
            option.
    """
    options = {ALIASES.get(k, k): v for k, v in options.items()}
    config = with_options(ServerConfig, config, options).validate()
    api_key, per_request = config.api_key, config.max_seqs_per_request
    metrics = Metrics(model_name, engine)
    state = ServerState(engine=engine, model_name=model_name, metrics=metrics, config=config,
                        max_seqs_per_request=min(per_request, engine.max_queue),
                        max_seqs_option=("--max-seqs-per-request" if per_request <= engine.max_queue
                                         else "--max-queue"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.serving()
        yield
        if shutdown_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="unmask", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for diffusion language models. Errors use the OpenAI error "
                              "body; streamed responses are server-sent events ending with `data: [DONE]`.")
    app.state.unmask = state
    install_handlers(app)
    app.add_middleware(BodyLimitsMiddleware)  # inside the guard: structure bounds off the event loop
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=config.max_body_bytes, router=app.router,
                       api_keys=config.api_keys)
    app.add_middleware(RequestIdMiddleware)  # outside the guards: their refusals carry the id too
    if config.cors_origins:  # outermost: preflights are answered and error responses carry the CORS headers too
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    def model_card() -> R.ModelCard:
        return R.ModelCard(id=model_name, created=state.created, max_model_len=state.max_context)

    @app.get("/v1/models", response_model=R.ModelList, responses=_ERRORS)
    async def list_models():
        """The served model."""
        return R.ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=R.ModelCard, responses=_ERRORS)
    async def get_model(model_id: str):
        """One model by id (404 for an unknown id)."""
        check_model(model_id, model_name)
        return model_card()

    @app.post("/v1/completions", response_model=R.CompletionResponse, responses={
        **_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"}})
    async def completions(body: P.CompletionRequest, request: Request):
        """OpenAI completions (``prompt``: string, strings, token ids, or lists of token ids)."""
        arrival = time.time()
        check_model(body.model, model_name)
        prompts = await completion_ids(state, body.prompts())  # checked, then tokenized off the event loop
        return await _serve(state, "completion", body, prompts, arrival, request,
                            logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)

    @app.post("/v1/chat/completions", response_model=R.ChatCompletionResponse, responses={
        **_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream is true"}})
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        """OpenAI chat completions (messages rendered with the model's chat template or ``--chat-template``)."""
        arrival = time.time()
        check_model(body.model, model_name)
        ids = await chat_ids(state, [m.as_template_dict() for m in body.messages],
                             body.template_tools())  # templated off the loop
        return await _serve(state, "chat", body, [ids], arrival, request, logprobs=body.logprobs,
                            top_logprobs=body.top_logprobs or 0)

    @app.get("/health")
    async def health():
        """``{"status": "ok", "model", "running", "waiting", "batched_forwards", "steps"}`` (model calls of the
        engine, one per batch; a response's ``usage.nfe`` counts one choice's); 503 when the engine is not running."""
        body = {"status": "ok" if engine.alive else "unavailable", "model": model_name, **engine.stats()}
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "TokenizeChatRequest",
                         "TokenizeCompletionRequest", "DetokenizeRequest"):
                props = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {})
                if "model" in props:  # the schema names the one model this server has
                    props["model"]["enum"] = [model_name]
            for path in ("/v1/models/{model_id}",):
                op = schema.get("paths", {}).get(path, {}).get("get", {})
                for prm in op.get("parameters", []):
                    if prm.get("name") == "model_id":
                        prm["schema"]["enum"] = [model_name]
            if api_key is not None or config.api_keys:  # every route but the guard's open ones (docs/design.md#admission-and-limits)
                schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http",
                                                                                     "scheme": "bearer"}}
                for path, ops in schema.get("paths", {}).items():
                    for op in ops.values() if needs_key(path) else ():
                        op["security"] = [{"bearer": []}]
            schema["info"]["x-limits"] = dict(STRUCTURE_LIMITS)  # server/body_limits.py's bounds, 400 beyond
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    # POST /v1/responses (docs/design.md#tools-and-the-responses-api)
    from .responses_api import router as responses_router

    app.include_router(responses_router, responses=_ERRORS)
    # POST /tokenize, POST /detokenize, GET /version (vLLM's shapes)
    from .tokenize_api import router as tokenize_router

    app.include_router(tokenize_router, responses=_ERRORS)
    mount_visualizer(app)
    return app


def _rename_param(err: APIError, old: str, new: str) -> None:
    """Name the request's own field in an engine error: ``param`` and the message's leading ``old:``."""
    err.param = new
    if err.message.startswith(f"{old}:"):
        err.message = f"{new}:{err.message[len(old) + 1:]}"


async def _serve(state: ServerState, kind: str, body, prompts: list[list[int]], arrival: float, request: Request,
                 logprobs: bool, top_logprobs: int):
    """Submit one engine request per prompt and answer with JSON or SSE."""
    engine = state.engine
    explicit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    max_tokens = explicit if explicit is not None else state.default_max_tokens
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"
    try:  # the prompts' log-probabilities (echo + logprobs, prompt_logprobs), before any generation
        scores = await prompt_scores.score_all(engine, body, prompts)
    except Exception as exc:
        raise from_exception(exc) from exc
    if scores is not None and max_tokens == 0:  # lm-eval's log-likelihood requests: the prompt alone
        return JSONResponse(prompt_scores.prompt_only_body(
            response_id, int(arrival), state.model_name, body, prompts, echo_texts(state.tokenizer, body, prompts),
            scores, body.n, state.token_text))
    # ParamError -> 400; off the event loop: an enforced tool_choice checks every tool's schema (seconds for large
    # ones), docs/design.md#admission-and-limits
    params = await anyio.to_thread.run_sync(lambda: body.sampling_params(max_tokens, logprobs, state.default_cache))
    if len(prompts) * body.n > state.max_seqs_per_request:
        raise APIError(400, f"n: {len(prompts)} prompt(s) x n={body.n} choices exceed the server's limit of "
                            f"{state.max_seqs_per_request} sequences per request ({state.max_seqs_option})",
                       param="n", code="invalid_value")
    streams = []
    loop = asyncio.get_running_loop()

    def submit_all() -> None:  # building the requests checks every prompt id: off the event loop
        # one atomic admission for every prompt (docs/design.md#admission-and-limits): all of them queue or none does
        streams.extend(engine.submit_many(prompts, params, [f"{response_id}-{p}" for p in range(len(prompts))],
                                          n=body.n, fit_max_tokens=explicit is None, loop=loop, group=response_id,
                                          cache_salt=cache_salt(request.scope, body.cache_salt)))

    try:
        await anyio.to_thread.run_sync(submit_all)
    except anyio.get_cancelled_exc_class():  # the client went away while the requests were being built
        for s in streams:
            s.abort()
        raise
    except Exception as exc:
        for s in streams:
            s.abort()
        err = from_exception(exc)
        if kind == "chat" and err.param == "prompt":   # the chat prompt is the rendered `messages`
            _rename_param(err, "prompt", "messages")
            err.message = err.message.replace("the prompt (", "the messages (rendered prompt: ", 1)
        if err.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            _rename_param(err, "max_tokens", "max_completion_tokens")  # the chat request's own name for it
        if err.code in ("queue_full", "cache_full"):
            # earlier prompts of this request may have run before a later one was refused: their work as far as
            # their outputs tell (none of their events was read)
            state.metrics.record_failure(err.code, [(len(ids), finished_work(s)) for ids, s in zip(prompts, streams)])
        raise err from exc
    render = Render(kind, response_id, int(arrival), state.model_name, state.token_text, logprobs=logprobs,
                    top_logprobs=top_logprobs, include_usage=body.include_usage, n=body.n,
                    tool_parser=parser_factory(state.tool_call_parser, body),
                    echo=echo_texts(state.tokenizer, body, prompts), stream_options=body.stream_options)
    run = Run(state, render, prompts, streams, body.n, arrival)
    if body.stream:
        shutdown = anyio.Event()
        events = sse_events(run, body.include_denoising, state.request_timeout, shutdown)
        return stream_response(bounded(events, state.config.stream_buffer_bytes, run.abort, run.id),
                                   ping=15, sep="\n", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                   send_timeout=state.config.read_timeout,  # a client that stopped reading
                                   shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_SECONDS)
    result = await collect(run, request, state.request_timeout, state.shutdown_event())
    if result is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    if scores is not None:
        result = prompt_scores.add_to_body(result, kind, body, scores, body.n, state.token_text)
    return JSONResponse(result)
