"""A loaded diffusion model: the transformers module, its tokenizer and its :class:`DllmConfig`.

``load_model`` detects the family (``config.json`` ``dllm.family``; foreign checkpoints by ``architectures`` /
``model_type``; ``family=`` overrides) and hands over to the family adapter in ``unmask.engine.families``.
The denoiser only calls :meth:`LoadedModel.hidden_states` and :meth:`LoadedModel.logits`.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import CheckpointError, DllmConfig


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU. Raises ``ValueError`` for an unknown device string."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but CUDA is not available (this torch: {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} but only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "mps"):
        raise ValueError(f"device: {device!r} is not one of auto, cpu, cuda, cuda:N")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA with bf16 support, float16 on other CUDA, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(table)}")
    return table[dtype]


@dataclass
class LoadedModel:
    """A model ready for the denoiser.

    Attributes:
        model: a transformers causal-LM module (``.base_model`` -> decoder stack, output embeddings -> LM head),
            loaded with ``attn_implementation="sdpa"`` so that boolean 4-D masks take effect.
        tokenizer: its tokenizer (chat template included when the checkpoint has one).
        dllm: the diffusion settings.
        path: where it was loaded from.
        device, dtype: where the weights live.
        max_context: the longest canvas (prompt + generation + suffix) the model accepts, in tokens.
        router: a ``routed.RowRouter`` when the checkpoint has a verifier (``dllm.verifier``), else None.
        weight_format: how the linear layers run: ``native`` (as loaded) or ``fp16`` (fbgemm-packed, see
            :mod:`unmask.engine.packed_weights`; set by :meth:`pack_weights`, which also fuses the projections of
            Llama-architecture models and runs them through :class:`~unmask.engine.fused_decoder.FusedDecoder`).
        draft_head: a :class:`~unmask.engine.draft_head.DraftHeadRuntime` when the checkpoint has one
            (``dllm.draft_head``): speculative requests then draft with it.
    """

    model: Any
    tokenizer: Any
    dllm: DllmConfig
    path: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    router: Any = None
    weight_format: str = "native"
    draft_head: Any = None

    def __post_init__(self) -> None:
        self.model.eval()
        self._decoder = self.model.base_model
        self._head = self.model.get_output_embeddings()
        self._vocab_size = int(self._head.weight.shape[0])
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._fused = None  # a FusedDecoder once pack_weights fused the projections

    @property
    def decoder_path(self) -> str:
        """Which forward runs the decoder: ``fused`` (:class:`~unmask.engine.fused_decoder.FusedDecoder`, packed
        Llama-architecture models) or ``transformers`` (the model's own forward)."""
        return "fused" if self._fused is not None else "transformers"

    def attach_verifier(self, verifier_model) -> None:
        """Route the causal rows of speculative requests to ``verifier_model``'s weights
        (:func:`unmask.engine.routed.attach_verifier`; raises its ``ValueError`` for another architecture)."""
        from .routed import attach_verifier

        if self.weight_format != "native":
            raise ValueError("attach the verifier before packing the weights (load_model does both in that order)")
        self.router = attach_verifier(self.model, verifier_model)
        self._head = self.model.get_output_embeddings()

    def pack_weights(self, weight_format: str) -> None:
        """Run the linear layers in ``weight_format`` (``auto`` | ``native`` | ``fp16``, see
        :mod:`unmask.engine.packed_weights`); once per model, after any verifier is attached. Inference only.

        Raises:
            ValueError: (names ``weights``) an unknown format or one this device cannot run; packing twice.
        """
        from .fused_decoder import FusedDecoder, fuse_projections
        from .packed_weights import fp16_linear, pack_linears_fp16, resolve_weight_format

        fmt = resolve_weight_format(weight_format, self.device, self.dtype)
        if fmt == self.weight_format:
            return
        if self.weight_format != "native":
            raise ValueError(f"weights: the linear layers are already packed as {self.weight_format}; load the "
                             f"checkpoint again for {fmt}")
        # q|k|v and gate|up become one packed GEMM each (fused layer by layer), then every other linear is packed
        fused = fuse_projections(self._decoder, make_linear=fp16_linear)
        pack_linears_fp16(self.model)
        if self.draft_head is not None:
            self.draft_head.pack_fp16()
        self._head = self.model.get_output_embeddings()
        self.weight_format = fmt
        self._fused = FusedDecoder(self._decoder) if fused else None

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (logits width)."""
        return self._vocab_size

    @property
    def has_row_variant(self) -> bool:
        """Whether some rows can run other weights than the model's own (a checkpoint's verifier today)."""
        return self.router is not None

    def enable_compile(self) -> None:
        """Run the decoder forward through ``torch.compile(dynamic=True)`` (same results; the first steps of each
        new shape pay the compilation; measured in ``benchmarks/bench_overhead.py --compile``).

        Raises:
            ValueError: (names ``compile``) the linear layers are packed (torch.compile does not trace them).
        """
        if self.weight_format != "native":
            raise ValueError(f"compile: torch.compile does not trace fbgemm-packed ({self.weight_format}) linear "
                             f"layers; load with weights='native' to compile")
        self._decoder = torch.compile(self.model.base_model, dynamic=True)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                      cache=None, variant_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states ``[B, Q, H]`` for ``input_ids``/``position_ids`` ``[B, Q]`` int64 and a boolean mask
        ``[B, 1, Q, C + Q]`` (C = cached keys in ``cache``, a :class:`~unmask.engine.kv_cache.BatchKV`).

        ``variant_rows`` (``[B, Q]`` bool): rows that run the model's row variant (the verifier's weights,
        ``unmask.engine.routed``); ``None``: every row runs the model's own weights.
        """
        if self._fused is not None:
            with self.routing(variant_rows):
                return self._fused(input_ids, position_ids, attention_mask, cache)
        kwargs = {self._cache_kw: cache, "use_cache": False}
        with self.routing(variant_rows):
            out = self._decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                **kwargs)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor, variant_rows: torch.Tensor | None = None) -> torch.Tensor:
        """LM head on ``[N, H]`` hidden states -> ``[N, V]`` float32 logits (``variant_rows``: ``[N]`` bool, as in
        :meth:`hidden_states`)."""
        with self.routing(variant_rows):
            return self._head(hidden).float()

    @contextlib.contextmanager
    def routing(self, variant_rows: torch.Tensor | None):
        """Context in which routed modules run ``variant_rows`` on the verifier (a no-op without one)."""
        if self.router is None or variant_rows is None:
            yield
            return
        self.router.drafter_rows = ~variant_rows
        try:
            yield
        finally:
            self.router.drafter_rows = None


def read_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint directory as a dict.

    Raises:
        CheckpointError: the directory or file is missing, or the JSON is invalid (with line and column).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a checkpoint directory with config.json)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing (expected a Hugging Face checkpoint directory)")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from exc


def resolve_model_path(name_or_path: str) -> Path:
    """A local directory as is (a training output directory resolves to its ``latest`` checkpoint); an
    ``org/name`` hub id through huggingface_hub (uses the local cache offline).

    Raises:
        CheckpointError: neither a directory nor a resolvable hub id.
    """
    p = Path(name_or_path).expanduser()
    if p.is_dir() and not (p / "config.json").exists() and (p / "latest").is_file():
        # a training OUT directory: its `latest` file names the newest checkpoint-<step>
        latest = p / (p / "latest").read_text().strip()
        if latest.is_dir():
            return latest
    if p.exists():
        return p
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name_or_path))
        except Exception as exc:  # network or cache miss
            raise CheckpointError(f"{name_or_path}: not a local directory and not downloadable from the hub ({exc})") from exc
    raise CheckpointError(f"{name_or_path}: no such directory")


def load_model(name_or_path: str | os.PathLike, family: str | None = None, device: str = "auto",
               dtype: str = "auto", weights: str = "auto") -> LoadedModel:
    """Load any supported dLLM checkpoint.

    Args:
        name_or_path: a checkpoint directory, or a hub id where a network (or the local hub cache) exists.
        family: force a family (``a2d``, ``llada``, ``dream``, ``fast_dllm_v2``, ``sdar``); default: detect.
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``. dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``.
        weights: how the linear layers run (:mod:`unmask.engine.packed_weights`): ``auto`` (fbgemm-packed fp16 on
            a CPU with fbgemm, else as loaded), ``native`` (as loaded: float32/bf16, or bitsandbytes nf4/int8),
            ``fp16``. Inference only: train from a ``native`` load.

    Raises:
        CheckpointError: the directory is not a checkpoint of a known family (the message says what was expected).
        ValueError: a bad ``device``, ``dtype`` or ``weights`` (the message names it).
    """
    from .families import detect_family, get_family

    path = resolve_model_path(str(name_or_path))
    config = read_config(path)
    name = family or detect_family(config, path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    from .packed_weights import resolve_weight_format

    fmt = resolve_weight_format(weights, dev, dt)  # bad values fail before the weights are read
    loaded = get_family(name).load(path, config, dev, dt)
    loaded.pack_weights(fmt)
    return loaded
