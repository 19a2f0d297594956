"""Training's shared pieces: its errors, checkpoint discovery (``OUT/latest``), the AR parent's one loader, the one
EOS rule, and the seeds and hashes that make a run reproducible (docs/design.md#training).

Every other training module may import this one; it imports only the engine.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import os
from pathlib import Path

import torch

from unmask.engine.config import CheckpointError

# end-of-turn / end-of-text tokens of common chat templates (ChatML, Llama 3, Gemma, Phi-3, SmolLM, Qwen)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>",
                      "<end_of_turn>", "<|end|>")


class TrainError(ValueError):
    """A bad training setting or input (the message names the option or file)."""


class ConversionError(ValueError):
    """Invalid conversion input (a bad argument, a missing or ambiguous source). The message names the argument
    or the file at fault."""


# ---------------------------------------------------------------------------------------------------- checkpoints
def resolve_latest(out: str | Path) -> Path | None:
    """``OUT/<name in OUT/latest>`` (a full or an adapter-only checkpoint), or None when there is no ``latest``
    file.

    Raises:
        TrainError: ``latest`` names no checkpoint directory.
    """
    out = Path(out)
    f = out / "latest"
    if not f.is_file():
        return None
    name = f.read_text().strip()
    if not name or "/" in name:
        raise TrainError(f"{f}: does not name a checkpoint directory")
    ckpt = out / name
    # a full checkpoint, or an adapter-only one (--trainable mask_lora: mask_adapter.json, no config.json)
    if not ((ckpt / "config.json").is_file() or (ckpt / "mask_adapter.json").is_file()):
        raise TrainError(f"{f}: points at {ckpt}, which is not a checkpoint")
    return ckpt


# ---------------------------------------------------------------------------------------------------- the parent
def resolve_source(src: str | os.PathLike, gguf_file: str | None = None) -> tuple[Path, str | None]:
    """Where a model is (training's one source resolver: the AR parent of conversion and distillation, the source
    of an export): ``(directory, gguf file name or None)``.

    Rules: ``src`` may be a ``.gguf`` file; a directory with ``gguf_file`` names a GGUF file inside it; a training
    ``OUT`` (with a ``latest`` file) is its latest checkpoint; a directory with ``config.json`` is a Hugging Face
    checkpoint; a directory without ``config.json`` holding exactly one ``.gguf`` file uses that file. A hub id
    (``org/name``) is resolved through huggingface_hub where a network (or the local hub cache) exists.

    Raises:
        ConversionError: ``src`` does not exist, the GGUF file is missing, the directory holds several GGUF files
            and no ``config.json`` (the message lists them and asks for ``--gguf-file``), or ``latest`` does not
            name a checkpoint.
    """
    p = Path(src).expanduser()
    if not p.exists():
        from unmask.engine.model import resolve_model_path

        try:
            p = resolve_model_path(str(src))
        except CheckpointError as exc:
            raise ConversionError(f"SRC: {exc}") from exc
    if p.is_file():
        if gguf_file is not None and gguf_file != p.name:
            raise ConversionError(f"--gguf-file: {gguf_file!r} given but SRC {p} is itself a file")
        if p.suffix.lower() != ".gguf":
            raise ConversionError(f"SRC: {p} is a file but not a .gguf file (give a model directory or a GGUF file)")
        return p.parent, p.name
    if gguf_file is not None:
        if not (p / gguf_file).is_file():
            found = sorted(x.name for x in p.glob("*.gguf"))
            raise ConversionError(f"--gguf-file: {p / gguf_file} does not exist (GGUF files in {p}: {found or 'none'})")
        return p, gguf_file
    if (p / "latest").is_file():
        try:
            return resolve_latest(p), None
        except TrainError as exc:
            raise ConversionError(str(exc)) from exc
    if (p / "config.json").is_file():
        return p, None
    ggufs = sorted(x.name for x in p.glob("*.gguf"))
    if len(ggufs) == 1:
        return p, ggufs[0]
    if len(ggufs) > 1:
        raise ConversionError(f"SRC: {p} holds several GGUF files {ggufs}; choose one with --gguf-file NAME")
    raise ConversionError(f"SRC: {p} has neither config.json nor a .gguf file (expected a Hugging Face causal-LM "
                          "directory or a GGUF file)")


def _no_init():
    """transformers' ``no_init_weights`` context (skips random initialisation), or a no-op where absent."""
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:  # pragma: no cover - transformers 4.x
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def plain_copy_of_gguf_model(model):
    """A serialisable copy of a GGUF-loaded model (docs/design.md#the-real-model).

    transformers 5 refuses ``save_pretrained`` on a model loaded with ``gguf_file`` ("quantized with gguf and is
    not serializable") although its weights are already de-quantised. This builds a model of the same class from a
    copy of the config without ``quantization_config`` and loads the state dict strictly, so the copy's logits are
    identical. Tied embeddings are re-tied.

    Raises:
        RuntimeError: the state dict does not fit the rebuilt model (missing/unexpected keys).
    """
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    dtype = next(model.parameters()).dtype
    with _no_init():
        plain = type(model)(cfg)
    plain.to(dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


def load_parent(src: str | os.PathLike, gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu"):
    """Load the AR parent (training's one parent loader: conversion, the distillation teacher, the KL teacher, the
    quality benchmark) as ``(model, tokenizer)``: eval mode, frozen, sdpa attention, loaded on CPU and moved to
    ``device``. ``src`` and ``gguf_file`` are located by :func:`resolve_source` (a Hugging Face directory - an a2d
    checkpoint also works: run causally it is its parent -, a GGUF file or a directory holding one); a GGUF parent
    goes through transformers' ``gguf_file`` and is returned as a plain serialisable model.

    Raises:
        ConversionError: see :func:`resolve_source`; ``dtype`` or ``device`` is not usable, or the weights or the
            tokenizer cannot be loaded (the message names the path); a quantized non-GGUF source.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unmask.engine.model import resolve_device, resolve_dtype

    src_dir, gguf_file = resolve_source(src, gguf_file)
    try:
        dev = resolve_device(device)
    except ValueError as exc:
        raise ConversionError(f"--{exc}") from exc
    try:
        torch_dtype = resolve_dtype(dtype, dev)
    except ValueError as exc:
        raise ConversionError(f"--dtype: {exc}") from exc
    where = src_dir / gguf_file if gguf_file else src_dir
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src_dir), **kw)
    except Exception as exc:
        raise ConversionError(f"SRC: cannot load the tokenizer from {where} ({exc})") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch_dtype, attn_implementation="sdpa", **kw)
    except Exception as exc:
        raise ConversionError(f"SRC: cannot load a causal LM from {where} ({exc})") from exc
    if gguf_file or getattr(model.config, "quantization_config", None) is not None:
        quant = getattr(model.config, "quantization_config", None)
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if gguf_file or str(getattr(method, "value", method)) == "gguf":
            model = plain_copy_of_gguf_model(model)
        else:
            raise ConversionError(f"SRC: {where} is quantized ({method}); convert the full-precision model")
    model.to(dev).eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    return model, tokenizer


def eos_ids_of(tokenizer, model=None, extra=None) -> list[int]:
    """Training's one EOS rule, built on the engine's :func:`~unmask.engine.families.common.resolve_eos_token_ids`:
    EOS and end-of-turn ids in order of preference - the tokenizer's EOS, then (with ``model``) the generation
    config's and the model config's EOS id(s), then the known end-of-turn tokens present in the vocabulary
    (``END_OF_TURN_TOKENS``: ``<|im_end|>``, ``<|eot_id|>``, ...), then ``extra`` (e.g. ``dllm.eos_token_ids``).
    The conversion writes this list into ``dllm.eos_token_ids``; the data loader and the distillation teachers end
    answers at (the set of) it.

    Returns:
        the ids without duplicates; empty when there is no EOS at all (:func:`convert_model` refuses that).
    """
    from unmask.engine.families.common import resolve_eos_token_ids

    gen = getattr(model, "generation_config", None) if model is not None else None
    config = {"eos_token_id": getattr(model.config, "eos_token_id", None)} if model is not None else {}
    try:
        ids = resolve_eos_token_ids(None, config, tokenizer, END_OF_TURN_TOKENS, [], None,
                                    generation_config={"eos_token_id": getattr(gen, "eos_token_id", None)},
                                    tokenizer_first=True)
    except CheckpointError:
        ids = []
    return ids + [t for t in dict.fromkeys(int(t) for t in extra or []) if t not in ids]


# ---------------------------------------------------------------------------------------------------- seeds, hashes
def seed_of(*parts: int) -> int:
    """A 63-bit seed from integers (sha256 of their decimal text): the run's seeds of data order, noise and init."""
    h = hashlib.sha256(",".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def ids_hash(ids) -> str:
    """sha256 (hex) of a token-id sequence (int64 little-endian bytes): an example's key in recorded files."""
    t = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.int64).cpu()
    return hashlib.sha256(t.numpy().astype("<i8").tobytes()).hexdigest()
