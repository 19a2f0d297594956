"""Model-family adapters (docs/design.md#model-families). Each module exposes ``ADAPTER``, a :class:`FamilyAdapter`.

A family adapter says whether a ``config.json`` belongs to it (``detect``) and loads the checkpoint onto the
matching transformers architecture without ``trust_remote_code`` (``load``), returning a
:class:`~unmask.engine.model.LoadedModel` whose :class:`~unmask.engine.config.DllmConfig` carries the family's
attention mode, logit shift, block alignment and mask/EOS ids.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import FAMILIES, CheckpointError


@dataclass(frozen=True)
class FamilyAdapter:
    """``detect(config_dict) -> bool``; ``load(path, config_dict, device, dtype) -> LoadedModel``."""

    name: str
    detect: Callable[[dict], bool]
    load: Callable


def get_family(name: str) -> FamilyAdapter:
    """The adapter for ``name``. Raises CheckpointError for an unknown family."""
    if name not in FAMILIES:
        raise CheckpointError(f"family: {name!r} is not one of {list(FAMILIES)}")
    module = importlib.import_module(f"{__name__}.{name}")
    return module.ADAPTER


def available_families() -> list[FamilyAdapter]:
    """Adapters whose module exists (in detection order: our own ``a2d`` first)."""
    out = []
    for name in FAMILIES:
        try:
            out.append(get_family(name))
        except ModuleNotFoundError:
            continue
    return out


def detect_family(config: dict, path: Path | str = "") -> str:
    """Family of a checkpoint from its ``config.json``.

    Raises:
        CheckpointError: no family recognises it; the message lists what each family expects.
    """
    dllm = config.get("dllm")
    if isinstance(dllm, dict) and "family" in dllm:
        return str(dllm["family"])
    for adapter in available_families():
        if adapter.detect(config):
            return adapter.name
    arch = config.get("architectures")
    raise CheckpointError(
        f"{Path(path) / 'config.json'}: not a diffusion checkpoint unmask knows (architectures={arch}, "
        f"model_type={config.get('model_type')!r}). Expected a `dllm` section (an `unmask convert` output), or "
        "LLaDA (LLaDAModelLM), LLaDA-MoE (LLaDAMoEModelLM), Dream (DreamModel), Fast-dLLM v2 "
        "(Fast_dLLM_QwenForCausalLM), SDAR (SDARForCausalLM) or LLaDA2.x (LLaDA2MoeModelLM). Convert an "
        "autoregressive checkpoint first: `unmask convert SRC OUT`."
    )
