"""Helpers shared by the family adapters: tokenizer loading, placing weights, context length."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import CheckpointError


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer (AutoTokenizer, no remote code). Raises CheckpointError when absent."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({exc})") from exc


def max_context_of(config: dict, default: int = 4096) -> int:
    """The model's context length from the usual config keys."""
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "max_seq_len"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return default


def from_pretrained(cls, path: Path, config: dict, device: torch.device, dtype: torch.dtype, **kwargs):
    """``cls.from_pretrained`` with sdpa attention, placing quantized (bitsandbytes) weights with a device map."""
    quantized = isinstance(config.get("quantization_config"), dict)
    try:
        if quantized:
            model = cls.from_pretrained(str(path), attn_implementation="sdpa", dtype=dtype,
                                        device_map={"": str(device)}, **kwargs)
        else:
            model = cls.from_pretrained(str(path), attn_implementation="sdpa", dtype=dtype, **kwargs)
            model.to(device)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{path}: cannot load the weights ({exc})") from exc
    return model
