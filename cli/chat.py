"""``unmask chat``: a terminal chat against any unmask (or OpenAI-compatible) server with a live denoising view."""
from __future__ import annotations

import argparse
import os

from unmask.engine.limits import REMASKING_STRATEGIES


def default_base_url(environ) -> str:
    """``$UNMASK_BASE_URL``, else the local server on ``$UNMASK_PORT`` (the port ``unmask serve`` reads; 8000)."""
    if environ.get("UNMASK_BASE_URL"):
        return environ["UNMASK_BASE_URL"]
    return f"http://127.0.0.1:{environ.get('UNMASK_PORT') or 8000}/v1"


def register(sub, name):
    """Add the ``unmask chat`` sub-parser (named ``name``); returns it."""
    p = sub.add_parser(name, help="chat with a server in the terminal, watching every denoising step",
                       description="Multi-turn chat over the OpenAI API with the canvas redrawn as it is denoised "
                                   "(plain streamed text when stdout is not a terminal). Ctrl-C stops an answer, "
                                   "Ctrl-D or /quit leaves, /help lists the slash commands.")
    p.add_argument("--base-url", default=default_base_url(os.environ),
                   help="the server's /v1 URL (default $UNMASK_BASE_URL, else http://127.0.0.1:$UNMASK_PORT/v1, the "
                        "port unmask serve reads, 8000 when unset)")
    p.add_argument("--api-key", default=None,
                   help="API key (default $UNMASK_API_KEY, else $OPENAI_API_KEY, else none)")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens per answer")
    p.add_argument("--steps", type=int, default=None, help="total denoising steps")
    p.add_argument("--block-size", type=int, default=None, help="block size")
    p.add_argument("--remasking", default=None, choices=list(REMASKING_STRATEGIES))
    p.add_argument("--threshold", type=float, default=None, help="confidence threshold (parallel decoding)")
    p.add_argument("--temperature", type=float, default=None, help="0 = argmax")
    p.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale")
    p.add_argument("--speculative", default=None, action=argparse.BooleanOptionalAction,
                   help="self-speculative decoding (default: the server's)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="any other request field, e.g. --set seed=1 --set ignore_eos=true (repeatable)")
    p.add_argument("--plain", action="store_true", help="plain streamed text even on a terminal")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the server (default 120)")
    return p


def options_from(args) -> dict:
    """The request fields the flags set."""
    from unmask.cli import UsageError
    from unmask.clients.chat import check_option, parse_value

    out = {}
    for flag, field in (("max_tokens", "max_tokens"), ("steps", "steps"), ("block_size", "block_size"),
                        ("remasking", "remasking"), ("threshold", "threshold"), ("temperature", "temperature"),
                        ("cfg_scale", "cfg_scale"), ("speculative", "speculative")):
        value = getattr(args, flag)
        if value is not None:
            why = check_option(field, value)
            if why is not None:
                raise UsageError(f"--{flag.replace('_', '-')}: {why}")
            out[field] = value
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise UsageError(f"--set: expected FIELD=VALUE, got {item!r}")
        why = check_option(field.strip(), parse_value(value))
        if why is not None:
            raise UsageError(f"--set {field.strip()}: {why}")
        out[field.strip()] = parse_value(value)
    return out


def run(args: argparse.Namespace) -> int:
    """Run the chat until Ctrl-D or /quit; 1 (and one line on stderr) when the server cannot be used."""
    import sys

    from unmask.clients.chat import Chat
    from unmask.clients.stream import Client, ClientError, resolve_api_key

    options = options_from(args)
    client = Client(args.base_url, resolve_api_key(args.api_key), timeout=args.timeout)
    try:
        model = args.model
        if model is None:
            models = client.models()
            if not models:
                print(f"unmask chat: error: {client.base_url}/models lists no model", file=sys.stderr)
                return 1
            model = models[0]
    except ClientError as exc:
        print(f"unmask chat: error: {exc}", file=sys.stderr)
        return 1
    chat = Chat(client, model, options, live=False if args.plain else None)
    if args.system:
        chat.messages.append({"role": "system", "content": args.system})
    try:
        return chat.loop()
    finally:
        client.close()
