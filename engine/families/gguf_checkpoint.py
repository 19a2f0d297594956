"""What a diffusion GGUF read by :mod:`.gguf_diffusion` is used for: served from memory (:func:`load_gguf`,
``unmask serve FILE.gguf``) or written out as the Hugging Face directory it came from (:func:`write_family_checkpoint`,
``unmask convert FILE.gguf OUT``); docs/design.md#model-families, "GGUF files"."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import CheckpointError
from .gguf_diffusion import GGUFCheckpoint, read_diffusion_gguf

__all__ = ["load_gguf", "write_family_checkpoint"]


def load_gguf(path: str | Path, family: str | None, device: torch.device, dtype: torch.dtype,
              max_magnitude: float):
    """A diffusion GGUF as a :class:`~unmask.engine.loaded.LoadedModel`: read, handed to its family adapter with
    the tensors and tokenizer in memory, checked as a directory is (ids, template, finite weights;
    docs/design.md#checks-at-load). ``family`` (``--family``) must match the file's when given.

    Raises:
        CheckpointError: one line naming the file (see the module docstring).
    """
    from ..checkpoint_check import _quiet_transformers as quiet_transformers, check_loaded, one_line
    from . import get_family

    try:
        with quiet_transformers():
            ckpt = read_diffusion_gguf(path)
            if family is not None and family != ckpt.family:
                raise CheckpointError(f"{path}: family {family!r} was asked for, but the file is "
                                      f"{ckpt.family} (general.architecture)")
            loaded = get_family(ckpt.family).load(Path(path), ckpt.config, device, dtype,
                                                  state_dict=ckpt.state_dict, tokenizer=ckpt.tokenizer)
    except CheckpointError as exc:
        raise CheckpointError(one_line(str(exc))) from exc
    except Exception as exc:  # a library's error while building the model
        raise CheckpointError(one_line(f"{path}: cannot load ({type(exc).__name__}: {exc})")) from exc
    unused = ckpt.unused_ids  # llama.cpp's [PADi] rows: never generated, as rows past a directory's tokenizer
    # part of loading (before load_model freezes the settings): a new config, no setting edited in place
    loaded.dllm = dataclasses.replace(loaded.dllm, suppress_token_ids=sorted(set(loaded.dllm.suppress_token_ids)
                                                                           | set(unused)))
    check_loaded(loaded, Path(path), max_magnitude)
    return loaded


def write_family_checkpoint(src: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """``unmask convert FILE.gguf OUT`` for a diffusion GGUF: the Hugging Face directory the file was converted from
    (the family's ``config.json`` keys and tensor names, ``model.safetensors`` in ``dtype``, the tokenizer with its
    chat template), written atomically (:mod:`unmask.engine.checkpoint`); ``unmask serve OUT`` loads it through
    the family adapter as it loads the GGUF.

    Raises:
        CheckpointError: the file cannot be read (see the module docstring).
        CheckpointWriteError: ``out`` exists and is not empty, or writing failed.
    """
    import json

    from safetensors.torch import save_file

    from ..checkpoint import (CheckpointWriteError, mark_temporary, publish_directory, remove_stale_temporaries,
                              unique_suffix)

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointWriteError(f"{out}: exists and is not empty; choose a new directory")
    ckpt = read_diffusion_gguf(src)
    tmp = out.parent / f"{out.name}.tmp-{unique_suffix()}"
    remove_stale_temporaries(out)
    try:
        mark_temporary(tmp)
        save_file({k: v.to(dtype).contiguous() for k, v in ckpt.state_dict.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config = dict(ckpt.config, torch_dtype=str(dtype).replace("torch.", ""),
                      gguf_source={"file": Path(src).name, "tensor_types": ckpt.tensor_types})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        ckpt.tokenizer.save_pretrained(str(tmp))
        if ckpt.unused_ids:  # the [PADi] entries stay in the vocabulary; never generated (common.unused_rows)
            (tmp / "generation_config.json").write_text(json.dumps({"suppress_tokens": ckpt.unused_ids}))
        if out.exists():
            out.rmdir()
        publish_directory(tmp, out)
    except OSError as exc:
        raise CheckpointWriteError(f"{out}: cannot write the checkpoint ({exc})") from exc
    return ckpt
