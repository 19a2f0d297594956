"""Wording the request models publish and refuse with: the OpenAI fields this server does not implement (each a 400
that says why) and the ``cache`` field's description (docs/design.md#decisions and #admission-and-limits)."""

# OpenAI request fields we do not implement -> why (a 400 names the field; never silently ignored; the whole policy:
# docs/api-fields.md)
UNSUPPORTED_FIELDS = {
    "functions": "the deprecated functions field is not supported: send tools",
    "function_call": "the deprecated function_call field is not supported: send tool_choice",
    "audio": "audio output is not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "reasoning_effort": "reasoning effort is not supported by this server",
    "verbosity": "verbosity control is not supported by this server",
    "moderation": "moderation is not run by this server",
}

# what each cache mode does on each attention type (docs/design.md#decisions "Cache"): prefix/dual on a causal model
# are accepted as its exact cache, on purpose, and said so here rather than left silent
CACHE_DESCRIPTION = ("KV-cache policy: auto | none | prefix | dual; absent: the server's --cache (default auto). auto: "
                     "the exact cache on prefix_causal and block_causal models, no cache on bidirectional ones; "
                     "none: no cache; prefix / dual: Fast-dLLM's approximate caches on bidirectional models (dual "
                     "caches the positions after the block too). On a prefix_causal or block_causal model prefix "
                     "and dual are its exact cache, the same as auto: it already forwards only the active block "
                     "and its output equals no cache's")
