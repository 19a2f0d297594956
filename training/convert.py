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

import re
from pathlib import Path

import torch

from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import ATTENTION_MODES, DllmConfig

# the parent's loader, the EOS rule and the error live in common.py (shared by all of training); named here too
from .common import ConversionError, eos_ids_of, load_parent, plain_copy_of_gguf_model, resolve_source

__all__ = ["ConversionError", "DEFAULT_MASK_TOKEN", "add_mask_rows", "check_softmax_layers", "choose_mask_token",
           "convert_checkpoint", "convert_model", "eos_ids_of", "load_parent", "plain_copy_of_gguf_model",
           "resolve_source"]

DEFAULT_MASK_TOKEN = "<|mask|>"
_RESERVED = re.compile(r"reserved|unused", re.IGNORECASE)


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
