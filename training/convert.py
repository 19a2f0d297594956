"""A2D conversion: an autoregressive Hugging Face causal LM -> an ``a2d`` diffusion checkpoint
(docs/design.md#training).

What :func:`convert_checkpoint` does, in order:

1. Load the AR parent: a Hugging Face directory (Llama, Qwen2, Qwen3, ... any ``AutoModelForCausalLM`` layout), or a
   GGUF file through transformers' ``gguf_file`` (de-quantised to float32). A GGUF-loaded model cannot be saved by
   transformers 5 ("quantized with gguf and is not serializable"), so the weights are moved into a plain model of
   the same class built from the config without its ``quantization_config`` (strict state-dict load: logits are
   identical; docs/design.md#the-real-model).
2. Choose the mask token: the source's ``dllm.mask_token_id`` when it already is a diffusion checkpoint; else the
   tokenizer's declared ``mask_token``; else ``mask_token`` when it is already in the vocabulary; else a reserved /
   unused special token (``<|reserved_special_token_0|>``, ``<unused0>``); else ``mask_token`` is added as a new
   special token.
3. Make room for it: when its id has no embedding row the input embeddings and the LM head are resized to
   ``mask_id + 1`` rows (this includes the common case where the tokenizer length already equals the vocabulary
   size). Tied embeddings stay tied. A padded vocabulary (more rows than tokens) needs no resize: the mask token
   takes the first free id and the rows past the tokenizer are listed in ``dllm.suppress_token_ids``.
4. Initialise the mask token's rows (new, reused reserved or padded rows alike; never a row of a real token): the
   embedding row is the mean of the real tokens' embedding rows; an untied head row is the mean head row (bias:
   mean bias). Predicting the mask token is forbidden by the engine anyway (``DllmConfig.never_generate_ids``).
5. Write an ``a2d`` checkpoint with :func:`unmask.engine.checkpoint.write_checkpoint`: weights, tokenizer with its
   chat template, generation config, and the ``dllm`` section (attention mode, block size, logit shift, EOS and
   end-of-turn ids, pad id, default sampling ``temperature: 0``).

With ``prefix_causal`` (or ``block_causal``) attention, logit shift and ``block_size=1`` the converted model decodes
exactly its AR parent's greedy output (docs/design.md#decoding); ``tests/test_convert.py`` checks that.
"""
from __future__ import annotations

import contextlib
import copy
import os
import re
from pathlib import Path

import torch

from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import ATTENTION_MODES, CheckpointError, DllmConfig

DEFAULT_MASK_TOKEN = "<|mask|>"
# end-of-turn / end-of-text tokens of common chat templates (ChatML, Llama 3, Gemma, Phi-3, SmolLM, Qwen)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>",
                      "<end_of_turn>", "<|end|>")
_RESERVED = re.compile(r"reserved|unused", re.IGNORECASE)


class ConversionError(ValueError):
    """Invalid conversion input (a bad argument, a missing or ambiguous source). The message names the argument
    or the file at fault."""


# ---------------------------------------------------------------------------------------------------- source
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
        from .trainer import TrainError, resolve_latest

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


# ---------------------------------------------------------------------------------------------------- mask token
def choose_mask_token(tokenizer, num_rows: int, mask_token: str = DEFAULT_MASK_TOKEN,
                      existing_dllm: dict | None = None) -> tuple[int, bool]:
    """Pick (or add) the mask token. Returns ``(mask_token_id, initialise_rows)``.

    ``initialise_rows`` is False only when the source already is a diffusion checkpoint (its mask row is trained).
    The tokenizer is modified in place (``mask_token`` set; a new special token added when needed).

    Args:
        tokenizer: the parent's tokenizer.
        num_rows: rows of the parent's input embedding (the vocabulary size).
        mask_token: the text of the token to reuse or add.
        existing_dllm: the source's ``dllm`` section, if any.
    """
    if existing_dllm and isinstance(existing_dllm.get("mask_token_id"), int):
        return int(existing_dllm["mask_token_id"]), False
    vocab = tokenizer.get_vocab()
    if tokenizer.mask_token is not None and tokenizer.mask_token in vocab:
        return int(vocab[tokenizer.mask_token]), True
    if mask_token in vocab:
        tokenizer.add_special_tokens({"mask_token": mask_token})
        return int(vocab[mask_token]), True
    special = set(tokenizer.all_special_tokens)
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    reserved = sorted(i for i, t in decoder.items()
                      if _RESERVED.search(str(t)) and (getattr(t, "special", False) or str(t) in special)
                      and i < num_rows)
    if reserved:
        tokenizer.add_special_tokens({"mask_token": str(decoder[reserved[0]])})
        return int(reserved[0]), True
    tokenizer.add_special_tokens({"mask_token": mask_token})
    return int(tokenizer.convert_tokens_to_ids(mask_token)), True


def add_mask_rows(model, mask_id: int, num_real_tokens: int, initialise: bool = True) -> None:
    """Make sure ``mask_id`` has an embedding row and a head row, and initialise them.

    Resizes input embeddings and LM head to ``mask_id + 1`` rows when ``mask_id`` is past the last row (ties are
    kept by ``resize_token_embeddings``). With ``initialise``: embedding row := mean of the rows of the real
    tokens ``[0, num_real_tokens)`` other than ``mask_id``; an untied head row := the mean head row over the same
    ids (and bias := mean bias). Other rows are not changed.

    Args:
        model: a transformers causal LM (float weights).
        mask_id: the mask token id.
        num_real_tokens: ids below this are real tokens of the parent's tokenizer (before the mask was added).
        initialise: set the mask rows (False keeps a trained mask row of an existing diffusion checkpoint).
    """
    emb = model.get_input_embeddings()
    rows = int(emb.weight.shape[0])
    if mask_id >= rows:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
        emb = model.get_input_embeddings()
    if not initialise:
        return
    real = torch.ones(int(emb.weight.shape[0]), dtype=torch.bool)
    real[min(num_real_tokens, real.numel()):] = False
    real[mask_id] = False
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.weight.data_ptr()
    with torch.no_grad():
        emb.weight[mask_id] = emb.weight[real].float().mean(0).to(emb.weight.dtype)
        if head is not None and not tied:
            head.weight[mask_id] = head.weight[real].float().mean(0).to(head.weight.dtype)
        if head is not None and getattr(head, "bias", None) is not None:
            head.bias[mask_id] = head.bias[real].float().mean().to(head.bias.dtype)


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


# ---------------------------------------------------------------------------------------------------- convert
def convert_checkpoint(src, out, attention="prefix_causal", block_size=4, logit_shift=True, gguf_file=None,
                       mask_token="<|mask|>", dtype="float32") -> Path:
    """Convert an AR causal LM into a servable ``a2d`` checkpoint (see the module docstring for the rules).

    Args:
        src: Hugging Face causal-LM directory (Llama, Qwen2, Qwen3, ...), a directory holding a GGUF file, a
            ``.gguf`` file, or a hub id where a network exists.
        out: output directory; must not exist or be empty (written atomically).
        attention: ``prefix_causal`` (recommended for AR parents) | ``block_causal`` | ``bidirectional``.
        block_size: the block size written as the checkpoint default (tokens, >= 1).
        logit_shift: True for AR parents (position j's token is read from output j - 1).
        gguf_file: name of the GGUF file inside ``src``.
        mask_token: text of the mask token to reuse or add.
        dtype: weights dtype of the output: ``float32`` (default) | ``bfloat16`` | ``float16``.

    Returns:
        ``Path(out)``.

    Raises:
        ConversionError: a bad argument or source (names the argument or file).
        unmask.engine.checkpoint.CheckpointWriteError: ``out`` is not empty or the write failed.
    """
    if attention not in ATTENTION_MODES:
        raise ConversionError(f"attention: {attention!r} is not one of {', '.join(ATTENTION_MODES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConversionError(f"block_size: must be a positive integer, got {block_size!r}")
    if not isinstance(mask_token, str) or not mask_token:
        raise ConversionError(f"mask_token: must be a non-empty string, got {mask_token!r}")
    _check_out(out)
    model, tokenizer = load_parent(src, gguf_file, dtype)
    return convert_model(model, tokenizer, out, attention=attention, block_size=block_size, logit_shift=logit_shift,
                         mask_token=mask_token)


def check_softmax_layers(config) -> None:
    """Refuse a parent whose ``layer_types`` include recurrent layers (Gated DeltaNet ``linear_attention`` in
    Qwen3-Next/3.5, Mamba-style ``mamba``/``conv`` layers): an attention mask cannot make a recurrence
    bidirectional, and the engine's cache holds keys/values, not recurrent state (docs/big-model.md, "Gated DeltaNet
    layers and A2D").

    Raises:
        ConversionError: (names ``SRC``) such layers, counted.
    """
    types = list(getattr(config, "layer_types", None) or [])
    recurrent = [t for t in types if t == "linear_attention" or "attention" not in str(t)]
    if recurrent:
        kinds = ", ".join(sorted(set(map(str, recurrent))))
        raise ConversionError(f"SRC: {len(recurrent)} of {len(types)} layers are recurrent ({kinds}); an attention "
                              f"mask cannot make them bidirectional and unmask's cache holds no recurrent state, so "
                              f"only softmax-attention parents convert (docs/big-model.md)")


def _check_out(out) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"OUT: {out} exists and is not an empty directory; choose a new directory")
    return out


def convert_model(model, tokenizer, out, attention="prefix_causal", block_size=4, logit_shift=True,
                  mask_token=DEFAULT_MASK_TOKEN) -> Path:
    """The conversion proper, on an already loaded AR parent (what :func:`convert_checkpoint` does after loading).

    ``model`` and ``tokenizer`` are modified in place (mask token added, embeddings resized); pass copies to keep
    the originals. ``model`` must be serialisable (for a GGUF-loaded model use :func:`plain_copy_of_gguf_model`).

    Returns:
        ``Path(out)``.

    Raises:
        ConversionError, CheckpointWriteError: as :func:`convert_checkpoint`.
    """
    if attention not in ATTENTION_MODES:
        raise ConversionError(f"attention: {attention!r} is not one of {', '.join(ATTENTION_MODES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConversionError(f"block_size: must be a positive integer, got {block_size!r}")
    check_softmax_layers(model.config)
    out = _check_out(out)
    existing = getattr(model.config, "dllm", None)
    existing = existing if isinstance(existing, dict) else None
    num_real = len(tokenizer)
    rows = int(model.get_input_embeddings().weight.shape[0])
    mask_id, initialise = choose_mask_token(tokenizer, rows, mask_token, existing)
    add_mask_rows(model, mask_id, num_real, initialise)
    rows = int(model.get_input_embeddings().weight.shape[0])
    head_rows = int(model.get_output_embeddings().weight.shape[0])
    if head_rows != rows:
        raise ConversionError(f"SRC: LM head has {head_rows} rows but the embedding has {rows}; unsupported layout")

    eos = eos_ids_of(tokenizer, model)
    if not eos:
        raise ConversionError("tokenizer: no EOS token (eos_token unset and no known end-of-turn token)")
    pad = tokenizer.pad_token_id
    if pad is None or pad == mask_id:
        pad = eos[0]
    # rows that no tokenizer token maps to (a padded vocabulary) are never generated
    suppress = list(range(len(tokenizer), rows))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = pad
    model.config.pad_token_id = pad
    dllm = DllmConfig(family="a2d", mask_token_id=mask_id, attention=attention, block_size=block_size,
                      logit_shift=bool(logit_shift), eos_token_ids=eos, pad_token_id=pad,
                      default_sampling={"temperature": 0.0}, suppress_token_ids=suppress)
    return write_checkpoint(out, model, tokenizer, dllm)
