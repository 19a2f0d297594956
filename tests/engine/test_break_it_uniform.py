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


def _text_config(**fields):
    def edit(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg["text_config"].update(fields)
        (path / "config.json").write_text(json.dumps(cfg))
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
    # was served with a context of 4096 (0 read as unset)
    (_text_config(max_position_embeddings=0), "config.json", [":text_config.max_position_embeddings:"]),
    # was "config.json:dllm.block_size: 8 exceeds the model's context of 4" (no such field in this checkpoint)
    (_text_config(max_position_embeddings=4), "config.json", [":canvas_length: 8 exceeds"]),
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


def test_a_last_canvas_past_the_context_end_keeps_what_fits_and_equals_generate(replica):
    """The layout's last block is clamped to the context (512 here) while a canvas is sampled whole: ending such a
    canvas wrote 8 tokens into fewer positions and failed the engine step (a 500)."""
    from diffusion_gemma_tiny import reference_generate
    from unmask.engine.llm import LLM
    from unmask.engine.params import SamplingParams

    model = load_model(str(replica), device="cpu")
    llm = LLM(model)
    for prompt_len, max_tokens in [(505, 7), (511, 1), (500, 12)]:
        prompt = [5 + i % 7 for i in range(prompt_len)]
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, seed=2, max_denoising_steps=2))[0]
        ids = out.outputs[0].token_ids
        assert len(ids) <= max_tokens and ids, (prompt_len, ids)
        want = reference_generate(model.model, prompt, 2, max_new_tokens=max_tokens, max_denoising_steps=2)
        assert ids == want[:max_tokens], (prompt_len, ids, want)
