"""The server's options (:class:`ServerConfig`): what ``build_app`` and ``unmask serve`` take besides the engine's
(``unmask.engine.EngineConfig``); each option once, with the metadata its flag and ``UNMASK_*`` variable are
generated from (``unmask.engine.options.option``, docs/design.md#layout-and-layers)."""
from __future__ import annotations

from dataclasses import dataclass

from unmask.engine import option
from unmask.engine.limits import CACHE_MODES, DEFAULT_MAX_SEQS_PER_REQUEST

__all__ = ["ServerConfig", "DEFAULT_MAX_BODY_BYTES", "LOG_LEVELS"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's options (defaults here and nowhere else).

    Raises (:meth:`validate`):
        ValueError: a value out of range, naming the field (``default_max_tokens: must be >= 1, got 0``).
    """

    host: str = option("127.0.0.1", "address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    port: int = option(8000, "TCP port to listen on (default 8000)")
    served_model_name: str | None = option(None, "model id clients send (default: directory name)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1/* (default: $UNMASK_API_KEY, "
                                       "else none)")
    api_key_file: str | None = option(
        None, "read the API key from this file (surrounding whitespace and the newline stripped), so that it shows "
              "neither in `ps` nor in the environment; overrides --api-key", metavar="PATH")
    api_keys_file: str | None = option(
        None, "a file of API keys, one per line: KEY, or KEY TENANT (blank lines and # comments skipped); each "
              "key is a tenant (several keys may name one), whose prefix-cache entries no other tenant can hit "
              "(docs/design.md#admission-and-limits); --api-key or --api-key-file is one more (unnamed) tenant",
        metavar="PATH")
    api_keys: dict | None = option(None, "API key -> tenant name (what --api-keys-file gives)", cli=False)
    max_seqs_per_request: int = option(
        DEFAULT_MAX_SEQS_PER_REQUEST, "most sequences (prompts x n) one request may queue, at most --max-queue "
                                      f"(default {DEFAULT_MAX_SEQS_PER_REQUEST}); beyond it a 400 naming n")
    default_max_tokens: int = option(256, "max_tokens when a request sends none (lowered to the remaining context "
                                          "and KV budget)")
    request_timeout: float | None = option(None, "abort requests after this many seconds")
    chat_template: str | None = option(
        None, "Jinja chat template file (overrides the tokenizer's), or the name of one shipped with unmask: "
              "chatml-tools (ChatML + Hermes tool calls, for ChatML models whose own template renders no tools, e.g. "
              "SmolLM2)")
    chat_special_tokens: bool = option(
        False, "parse special tokens typed inside chat message contents as control tokens (the old behaviour, for "
               "deployments whose clients send them on purpose); default off: they are plain text, so no message "
               "can fake a turn (completions prompts always parse them, as vLLM)", action="store_true")
    tool_call_parser: str = option(
        "hermes", "how chat answers are parsed into tool calls when a request has tools (hermes: "
                  "<tool_call>{json}</tool_call>, the Hermes/Qwen format; default hermes)", metavar="NAME")
    cors_origins: list[str] | None = option(None, "allowed CORS origins ('*' for any)", nargs="*")
    cache: str = option(
        "auto", "default KV-cache policy for requests that send none (prefix/dual: Fast-dLLM's approximate caches "
                "on bidirectional models; on prefix-/block-causal models they are the exact cache, as auto)",
        choices=CACHE_MODES)
    root_path: str = option(
        "", "the path prefix the server is reached under behind a reverse proxy that strips it (ASGI root_path, as "
            "uvicorn's --root-path), e.g. /unmask; the page at / uses it")
    log_level: str = option("info", "", choices=LOG_LEVELS)
    read_timeout: float = option(
        30.0, "seconds a client may take to send a request's head and body, and to accept one streamed chunk "
              "(slower: the connection is closed; uvicorn has no such limit); default 30")
    stream_buffer_bytes: int = option(
        8 * 1024 * 1024, "most bytes of one stream's events produced and not yet sent; past it (a client that "
                         "does not read) the request is aborted, freeing its batch slot (default 8 MiB)")
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "largest accepted request body (413 beyond)", cli=False)

    def validate(self) -> "ServerConfig":
        """Check every range; returns self.

        Raises:
            ValueError: naming the field; an unknown ``tool_call_parser`` or ``cache``.
        """
        from .tool_parsers import get_parser

        for name in ("max_seqs_per_request", "default_max_tokens", "max_body_bytes", "stream_buffer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.read_timeout > 0:  # NaN too
            raise ValueError(f"read_timeout: must be > 0 seconds, got {self.read_timeout}")
        if self.request_timeout is not None and not self.request_timeout > 0:  # NaN too
            raise ValueError(f"request_timeout: must be > 0 seconds, got {self.request_timeout}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port}")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache: must be one of {list(CACHE_MODES)}, got {self.cache!r}")
        get_parser(self.tool_call_parser)
        return self
