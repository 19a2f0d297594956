"""Breaking DiffusionGemma at load and in the engine (docs/design.md#checks-at-load; docs/design.md#decoding,
"Uniform canvas"): a corrupt checkpoint is refused in one line naming the file (and tensor or field)."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from diffusion_gemma_tiny import save_replica
from unmask.engine.config import CheckpointError
from unmask.engine.model import load_model


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_gemma")
    save_replica(path, canvas_length=8)
    return path


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _drop_q_proj(t):
    del t[next(k for k in sorted(t) if k.endswith("self_attn.q_proj.weight"))]


def _shorten_q_proj(t):
    k = next(k for k in sorted(t) if k.endswith("self_attn.q_proj.weight"))
    t[k] = t[k][:-1]


def _generation_config(**fields):
    def edit(path):
        gen = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    return edit


@pytest.mark.parametrize("edit, where, names", [
    # transformers filled a missing tensor with random values and only logged it: the model loaded and served noise
    (lambda p: _edit_tensors(p, _drop_q_proj), "model.safetensors", ["1 missing", "self_attn.q_proj.weight"]),
    # was "cannot load (RuntimeError: ... For details look at the above report!)": no file, no tensor
    (lambda p: _edit_tensors(p, _shorten_q_proj), "model.safetensors", ["q_proj.weight has shape [63, 64]"]),
    # was "config.json:dllm.default_sampling.max_denoising_steps" (the wrong file, no directory)
    (_generation_config(max_denoising_steps=0), "generation_config.json", [":max_denoising_steps:"]),
    # was "<dir>: cannot load (ValueError: `t_max` must be >= t_min` ...)"
    (_generation_config(t_min=0.9, t_max=0.5), "generation_config.json", [":t_max:"]),
])
def test_a_corrupt_checkpoint_is_refused_in_one_line_naming_the_file(replica, tmp_path, edit, where, names):
    bad = tmp_path / "bad"
    shutil.copytree(replica, bad)
    edit(bad)
    with pytest.raises(CheckpointError) as err:
        load_model(str(bad), device="cpu")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(bad / where)), msg
    assert all(n in msg for n in names), msg
