"""Configuration objects: each option once, as a dataclass field whose metadata the command line is generated from
(docs/design.md#layout-and-layers, "Options").

:func:`option` declares a field with its help, flag, choices and environment variable (:class:`Option`);
:class:`EngineConfig` holds the engine's options (loading, batching, queue, KV budget, prefix reuse, chunked prefill,
the draft policy, the default block and context). ``unmask.server.config.ServerConfig`` and
``unmask.training.config.TrainConfig`` use the same :func:`option`; ``unmask.cli.flags`` turns the fields into
``argparse`` options and ``UNMASK_*`` variables, ``unmask options`` lists them. Errors: ``ValueError`` whose message
starts with the field's name (``max_queue: must be >= 1, got 0``), which the command line renames to the flag or
variable the value came from.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .limits import DEFAULT_MAX_STEP_ROWS, DEFAULT_PREFILL_CHUNK, MAX_WEIGHT_MAGNITUDE

__all__ = ["Option", "option", "options_of", "EngineConfig", "with_options", "check_at_least"]


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line.

    Attributes:
        help: the ``--help`` text. flag: ``--name`` (default: the field's name, ``_`` as ``-``); a positional's
            name (``model``) when ``positional``. choices: allowed values (also checked in the environment), or a
            callable returning them when the parser is built (a registry's names).
        env: whether ``UNMASK_<NAME>`` sets it (serve's options; not train's). metavar: argparse's.
        cli: False for a field of the Python API only (no flag; e.g. ``compile``).
        action: an argparse action name (``store_true``, ``store_false``, ``negatable`` = ``--x / --no-x``);
            None = a typed value. nargs: argparse's (``*`` for a list). required: the flag must be given.
        parse: converts the flag's text (default: the field's type, int / float / str).
    """

    help: str
    flag: str | None = None
    choices: tuple | Callable[[], tuple] | None = None
    env: bool = True
    metavar: str | None = None
    cli: bool = True
    action: str | None = None
    nargs: str | None = None
    required: bool = False
    positional: bool = False
    parse: Callable[[str], Any] | None = None


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           **kw) -> Any:
    """A dataclass field with :class:`Option` metadata (``kw``: its attributes); ``factory`` for a mutable
    default. No default (and no factory): a required field."""
    meta = {"option": Option(help=help, **kw)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def options_of(cls) -> list[tuple[dataclasses.Field, Option]]:
    """``(field, Option)`` of every field of dataclass ``cls`` that declares one, in field order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def with_options(cls, config, options: dict):
    """``config`` (an instance of ``cls``, or None = its defaults) with ``options`` (field -> value) replaced: how
    ``LLM(dir, max_batch_size=8)`` and ``build_app(engine, name, api_key=...)`` keep their keyword spellings.

    Raises:
        TypeError: an option that is not a field of ``cls`` (names it), or ``config`` of another type.
    """
    if config is None:
        config = cls()
    if not isinstance(config, cls):
        raise TypeError(f"config: expected a {cls.__name__}, got {type(config).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unexpected option(s) {', '.join(unknown)} (not fields of {cls.__name__})")
    return dataclasses.replace(config, **options) if options else config


def check_at_least(config, names: tuple[str, ...], lo: int) -> None:
    """Raise ``ValueError("<name>: must be >= lo, got v")`` for the first of ``names`` whose value (None passes)
    is below ``lo``."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < lo:
            raise ValueError(f"{name}: must be >= {lo}, got {value}")


WEIGHTS = ("auto", "native", "fp16", "int8", "int4")
DRAFT_POLICIES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options: what ``LLM``, ``Engine``, ``AsyncEngine`` and ``unmask serve`` take (defaults here and
    nowhere else). ``model`` is what ``unmask serve`` loads (``LLM`` and the engines are handed the model itself);
    the loading options apply where a path is loaded (``LLM``, serve); ``block_size``, ``max_model_len`` and
    ``default_drafts`` are inputs to the decoding plan (``unmask.engine.plan.engine_defaults``); ``threads`` is set
    by ``unmask serve`` (``torch.set_num_threads``).

    Raises (:meth:`validate`):
        ValueError: a value out of range, naming the field.
    """

    model: str | None = option(None, "checkpoint directory or hub id (default: the A2D SmolLM2 default model)",
                               positional=True)
    max_batch_size: int = option(16, "sequences decoded together in one step")
    max_queue: int = option(256, "waiting sequences before 429")
    max_model_len: int | None = option(None, "lower the context length (tokens)")
    max_cached_tokens: int | None = option(
        None, "KV budget in canvas tokens over the running batch (default: unlimited); requests wait for room, one "
              "that alone exceeds it is a 400")
    gpu_memory_utilization: float = option(
        0.9, "on a GPU, the fraction of its memory the server may use (vLLM's option): the KV pool takes what the "
             "loaded model leaves of it, in blocks (docs/design.md#admission-and-limits)")
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = option("auto", "auto | float32 | bfloat16 | float16")
    default_drafts: str = option(
        "auto", "whether requests that get speculative decoding from the checkpoint's default draft: auto = not on "
                "a CPU (a speculative step costs ~2x a 1-token step there; the answers are the same either way), on, "
                "off", choices=DRAFT_POLICIES)
    weights: str = option(
        "auto", "how the linear layers run: auto = fbgemm-packed fp16 on a CPU (1.6-2.6x faster decoding than "
                "float32/nf4 there), int4 for weights on a 4-bit grid (a Q4 GGUF's, the default model's), as loaded "
                "elsewhere; native = as loaded; fp16 = packed (CPU only); int8 / int4 = weight-only low-bit CPU "
                "kernels (docs/scale.md)", choices=WEIGHTS)
    family: str | None = option(None, "force the model family (default: detect)")
    device_map: str | None = option(
        None, "split the layers between a device, CPU memory and disk (accelerate): auto | balanced | sequential "
              "(inferred under --max-memory), or a JSON object / JSON file of module -> cpu|disk|cuda:N "
              "(docs/scale.md); the weights then run natively")
    max_memory: str | None = option(
        None, "with --device-map auto|balanced|sequential: memory per device, e.g. 'cpu=2GiB,0=20GiB'")
    offload_folder: str | None = option(
        None, "with --device-map: where disk-offloaded weights go (default: a temporary directory)")
    parent: str | None = option(
        None, "the parent checkpoint of an adapter-only MODEL (default: the adapter's own parent.name; the parent's "
              "content hash is checked, docs/design.md#mask-row-adapter)", metavar="DIR")
    adapter: str | None = option(
        None, "a mask-row adapter directory to put on MODEL (default: the default model's conversion); its parent "
              "hash must match, else the server does not start (docs/design.md#mask-row-adapter)", metavar="DIR")
    block_size: int | None = option(
        None, "default block size for requests that send none, speculative or plain diffusion (default: the "
              "checkpoint's block_size, and its diffusion_block_size for plain diffusion)")
    enable_prefix_caching: bool = option(
        True, "keep the committed KV of recent prompts and answers (least recently used evicted first, within "
              "--max-cached-tokens, else 4096 tokens) and reuse it for requests whose prompts start the same way, "
              "e.g. the next turn of a chat; exact on prefix-/block-causal models, never used on bidirectional ones "
              "(default on; docs/design.md#prefix-reuse)", action="negatable")
    prefill_chunk: int = option(
        DEFAULT_PREFILL_CHUNK,
        "chunked prefill: a long prompt is forwarded in chunks of this many row-equivalents per step before its "
        "first denoising step, so that other requests keep decoding meanwhile; a row at position p counts 1 + p/P0 "
        "(P0 from the model's size, 3072 for SmolLM2-135M), so this is rows at the prompt's start and fewer further "
        f"on, where each row attends to more keys; 0 = the whole prompt in one step (default {DEFAULT_PREFILL_CHUNK}; "
        "docs/design.md#decoding)", metavar="ROWS")
    threads: int | None = option(
        None, "torch intra-op CPU threads (default on a CPU: one fewer than the cores torch sees, leaving one to the "
              "HTTP server, unless OMP_NUM_THREADS is set; 1 is often fastest on a busy CPU)")
    max_step_rows: int | None = option(
        DEFAULT_MAX_STEP_ROWS, "what one request may cost a step, in rows, over all its prompts and choices: "
        "block_size x n x lanes (2 under cfg_scale; a self-speculative draft block x (2 + branches)); a request "
        "beyond it is a 400 naming block_size (n where the checkpoint fixes the block size: one sequence is always "
        "admitted), and a step costs at most this beside the oldest waiting sequence, so "
        "a light request never waits behind more than one heavy step; each sequence and lane adds 2 rows, its "
        "measured cost beyond its rows (default 130: one block of 128, ~0.3 s a step for the default model on 2 "
        "cores; docs/design.md#admission-and-limits)", metavar="ROWS")
    max_weight_magnitude: float = option(
        MAX_WEIGHT_MAGNITUDE, "refuse a checkpoint or adapter holding a weight of larger magnitude (no trained "
        "model has one; SmolLM2-135M's largest is 9.3); 0 = no bound (docs/design.md#checks-at-load)",
        metavar="X")
    tensor_parallel_size: int = option(
        1, "shard attention heads and MLP columns/rows over this many processes (torch.distributed: gloo on CPU, "
           "NCCL on CUDA, one GPU each), started by unmask serve itself; weights run natively (docs/scale.md)",
        metavar="N")
    tensor_parallel_timeout: float = option(
        60.0, "seconds a tensor-parallel collective may wait for a rank: a rank that dies ends the server within "
              "it, with an error naming the group (default 60)", metavar="S")
    compile: bool = option(False, "torch.compile the decoder forward (unmask.engine.denoiser.Denoiser)", cli=False)
    cuda_graphs: bool = option(
        False, "capture the post-forward step (sampling and the reveal rule of the batched pass) as CUDA graphs, one "
               "per bucket of rows and block sizes at first use, replayed afterwards; CUDA only (an error on a CPU); "
               "constrained, speculative and block-refinement sequences stay eager, counted "
               "(docs/design.md#decoding)", action="store_true")

    def validate(self) -> "EngineConfig":
        """Check every range that needs no model; returns self.

        Raises:
            ValueError: naming the field (``max_queue: must be >= 1, got 0``).
        """
        check_at_least(self, ("max_batch_size", "max_queue", "max_model_len", "max_cached_tokens", "block_size",
                              "threads", "max_step_rows", "tensor_parallel_size"), 1)
        if not self.tensor_parallel_timeout > 0:  # NaN too
            raise ValueError(f"tensor_parallel_timeout: must be > 0 seconds, got {self.tensor_parallel_timeout}")
        if self.max_weight_magnitude < 0:
            raise ValueError(f"max_weight_magnitude: must be >= 0 (0 = no bound), got {self.max_weight_magnitude}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk: must be >= 0 (0 = off), got {self.prefill_chunk}")
        if not 0 < self.gpu_memory_utilization <= 1:  # NaN too
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        for name, allowed in (("default_drafts", DRAFT_POLICIES), ("weights", WEIGHTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        return self

    def load_options(self) -> dict:
        """The keywords of :func:`unmask.engine.model.load_model` (``weights`` stays ``native`` under ``compile``:
        torch.compile traces the weights as loaded, not fbgemm's packed kernels; and under tensor parallelism:
        packed kernels are not sharded)."""
        weights = ("native" if (self.compile or self.tensor_parallel_size > 1) and self.weights == "auto"
                   else self.weights)
        return dict(family=self.family, device=self.device, dtype=self.dtype, weights=weights,
                    device_map=self.device_map, max_memory=self.max_memory, offload_folder=self.offload_folder,
                    adapter=self.adapter, parent=self.parent, max_weight_magnitude=self.max_weight_magnitude)
