"""``a2d``: our own checkpoints (``unmask convert`` / ``unmask train`` / ``unmask export`` outputs).

Any Hugging Face causal-LM layout (Llama, Qwen2, Qwen3, ...) whose ``config.json`` has a ``dllm`` section; the
section is the single source of mask id, attention mode, block size, logit shift and EOS ids
(docs/design.md#checkpoints).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import CheckpointError, DllmConfig, warn_removed_fields
from ..loaded import LoadedModel
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
    warn_removed_fields(config["dllm"], f"{path / 'config.json'}:dllm")  # e.g. an old checkpoint's draft head
    model = from_pretrained(AutoModelForCausalLM, path, config, device, dtype)
    tokenizer = load_tokenizer(path)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, dllm=dllm, path=str(path), device=device, dtype=dtype,
                         max_context=max_context_of(config))
    if dllm.verifier:
        _attach_verifier(loaded, path)
    return loaded


def _attach_verifier(loaded: LoadedModel, path: Path) -> None:
    """Load ``dllm.verifier`` (relative to ``path`` unless absolute) and route ``loaded``'s causal rows to it.

    Raises:
        CheckpointError: the verifier is missing, not an ``a2d`` prefix-causal checkpoint with the logit shift, has
            a verifier itself, another tokenizer or mask id, or another architecture (names the file and field).
    """
    from transformers import AutoModelForCausalLM

    from ..loaded import read_config

    dllm, tokenizer, device, dtype = loaded.dllm, loaded.tokenizer, loaded.device, loaded.dtype
    where = f"{path / 'config.json'}:dllm.verifier"
    vpath = Path(dllm.verifier).expanduser()
    vpath = vpath if vpath.is_absolute() else path / vpath
    try:
        vconfig = read_config(vpath)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    if not detect(vconfig):
        raise CheckpointError(f"{where}: {vpath} is not an a2d checkpoint (no dllm section with family a2d)")
    vdllm = DllmConfig.from_dict(vconfig["dllm"], where=f"{vpath / 'config.json'}:dllm")
    if vdllm.verifier:
        raise CheckpointError(f"{where}: {vpath} names a verifier itself (chains are not supported)")
    if (vdllm.attention, vdllm.logit_shift, vdllm.mask_token_id) != (dllm.attention, dllm.logit_shift,
                                                                     dllm.mask_token_id):
        raise CheckpointError(f"{where}: {vpath} differs in attention/logit_shift/mask_token_id "
                              f"({vdllm.attention}/{vdllm.logit_shift}/{vdllm.mask_token_id} vs "
                              f"{dllm.attention}/{dllm.logit_shift}/{dllm.mask_token_id})")
    if (vdllm.eos_token_ids, vdllm.pad_token_id, vdllm.suppress_token_ids) != (
            dllm.eos_token_ids, dllm.pad_token_id, dllm.suppress_token_ids):
        raise CheckpointError(f"{where}: {vpath} differs in eos_token_ids/pad_token_id/suppress_token_ids (the "
                              "model's are applied when verifying, so the answers would not be the verifier's)")
    if load_tokenizer(vpath).get_vocab() != tokenizer.get_vocab():
        raise CheckpointError(f"{where}: {vpath} has another tokenizer vocabulary")
    try:
        verifier = from_pretrained(AutoModelForCausalLM, vpath, vconfig, device, dtype)
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    verifier.eval()
    from ..routed import route_to_verifier

    try:
        route_to_verifier(loaded, verifier)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {vpath}: {exc}") from exc


ADAPTER = FamilyAdapter(name="a2d", detect=detect, load=load)
