"""``a2d``: our own checkpoints (``unmask convert`` / ``unmask train`` / ``unmask export`` outputs).

Any Hugging Face causal-LM layout (Llama, Qwen2, Qwen3, ...) whose ``config.json`` has a ``dllm`` section; the
section is the single source of mask id, attention mode, block size, logit shift and EOS ids (DESIGN.md section 6).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import CheckpointError, DllmConfig
from ..model import LoadedModel
from . import FamilyAdapter
from .common import from_pretrained, load_tokenizer, max_context_of


def detect(config: dict) -> bool:
    """``config.json`` has a ``dllm`` object whose ``family`` is ``a2d``."""
    dllm = config.get("dllm")
    return isinstance(dllm, dict) and dllm.get("family") == "a2d"


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load an ``a2d`` checkpoint with ``AutoModelForCausalLM``; decoding settings come from its ``dllm`` section.

    Raises:
        CheckpointError: a missing or invalid ``dllm`` section, weights that cannot be loaded, no tokenizer.
    """
    from transformers import AutoModelForCausalLM

    if not isinstance(config.get("dllm"), dict):
        raise CheckpointError(f"{path / 'config.json'}: no `dllm` section (run `unmask convert` first)")
    dllm = DllmConfig.from_dict(config["dllm"], where=f"{path / 'config.json'}:dllm")
    model = from_pretrained(AutoModelForCausalLM, path, config, device, dtype)
    tokenizer = load_tokenizer(path)
    return LoadedModel(model=model, tokenizer=tokenizer, dllm=dllm, path=str(path), device=device, dtype=dtype,
                       max_context=max_context_of(config))


ADAPTER = FamilyAdapter(name="a2d", detect=detect, load=load)
