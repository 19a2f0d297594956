"""LLaDA2.x (``llada2``): the engine against diffusers' ``LLaDA2Pipeline`` + ``BlockRefinementScheduler`` on a tiny
random LLaDA2 built in unmask's own model code, with and without token editing; its checkpoint layout; its
refusals (docs/design.md#model-families, #decoding "Block refinement")."""
from __future__ import annotations

import json

import pytest
import torch

from llada2_tiny import checkpoint_dir, llada2_config_dict, loaded_llada2, pipeline_tokens
from unmask.engine import LLM, SamplingParams
from unmask.engine.config import CheckpointError
from unmask.engine.limits import ParamError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47], [100, 7, 99, 3, 2]]  # 8: aligned
# (block size, steps per block, threshold, editing threshold); prompt + max_tokens end on a block boundary (the
# pipeline hides the positions past gen_length from attention, the engine decodes whole blocks)
CASES = [(8, 8, 0.7, None), (4, 2, 0.9, None), (8, 4, 0.5, None), (8, 8, 0.7, 0.5), (4, 4, 0.6, 0.3)]


def _params(prompt: list[int], block: int, steps: int, threshold: float, editing, blocks: int = 3):
    """The engine request for a pipeline call of ``blocks`` blocks after the prompt's own (greedy)."""
    max_tokens = (len(prompt) // block + blocks) * block - len(prompt)
    n_blocks = -(-(len(prompt) + max_tokens) // block) - len(prompt) // block
    return max_tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, block_size=block, threshold=threshold,
                                      steps=steps * n_blocks, editing_threshold=editing)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_engine_gives_the_pipelines_tokens_alone_and_in_a_mixed_batch(seed):
    """Greedy (sampled draws differ by design: the engine's are counter-based per position, the pipeline's
    torch.multinomial over its batch): for each case the engine alone = the pipeline at batch 1 = the engine with
    every other case in one batch."""
    lm = loaded_llada2(seed=seed)
    llm = LLM(lm)
    requests, expected = [], []
    for i, (block, steps, threshold, editing) in enumerate(CASES):
        prompt = PROMPTS[(i + seed) % len(PROMPTS)]
        max_tokens, params = _params(prompt, block, steps, threshold, editing)
        expected.append(pipeline_tokens(lm, prompt, max_tokens, block, steps, threshold, editing))
        requests.append((prompt, params))
        alone = llm.generate([prompt], params)[0].outputs[0]
        assert alone.token_ids == expected[-1], (seed, CASES[i])
    mixed = dict(llm.generate_iter(iter(requests)))
    for i in range(len(CASES)):
        assert mixed[i].outputs[0].token_ids == expected[i], (seed, CASES[i])


def test_editing_changes_tokens_and_ends_blocks_by_its_rule():
    """Editing replaces committed tokens on this model (the comparison above is not vacuous) and the engine counts
    its steps: a block without masks takes at most max_post_steps + 1 editing steps."""
    lm = loaded_llada2(seed=1)
    llm = LLM(lm)
    prompt = PROMPTS[0]
    _, plain = _params(prompt, 8, 8, 0.7, None)
    _, edited = _params(prompt, 8, 8, 0.7, 0.5)
    a = llm.generate([prompt], plain)[0].outputs[0]
    b = llm.generate([prompt], edited)[0].outputs[0]
    assert a.token_ids != b.token_ids
    assert all(s <= 8 + 16 + 1 for s in b.steps_per_block)
    capped = llm.generate([prompt], SamplingParams(**{**edited.__dict__, "max_post_steps": 0}))[0].outputs[0]
    assert all(s <= 8 + 1 for s in capped.steps_per_block)


def test_events_mark_the_provisional_region_and_text_comes_from_finished_blocks_only():
    lm = loaded_llada2(seed=1)
    from unmask.engine.engine import Engine

    eng = Engine(lm)
    prompt = PROMPTS[0]
    _, params = _params(prompt, 8, 8, 0.7, 0.5)
    eng.add_request(prompt, params, "r")
    finals, texts = [], []
    while eng.has_unfinished():
        for ev in eng.step():
            texts.append(ev.text)
            if not ev.finished:
                finals.append(ev.final)
                final_ids = [t for t in ev.canvas[:ev.final] if t is not None]
                assert lm.tokenizer.decode(final_ids).startswith(ev.text)
    assert finals and all(f is not None for f in finals)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_checkpoint_layout_loads_and_gives_the_in_memory_models_logits(tmp_path):
    from unmask.engine.model import load_model

    lm = loaded_llada2(seed=3)
    path = checkpoint_dir(lm, tmp_path / "ckpt", shards=2)
    loaded = load_model(str(path), weights="native")
    assert loaded.dllm.family == "llada2" and loaded.dllm.attention == "block_causal"
    assert loaded.dllm.mask_token_id == lm.dllm.mask_token_id
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    assert torch.equal(loaded.model(ids).logits, lm.model(ids).logits)
    # and decodes as the in-memory model does (load_model's attention over each lane's own keys included)
    _, params = _params(PROMPTS[0], 8, 4, 0.6, 0.4)
    assert (LLM(loaded).generate([PROMPTS[0]], params)[0].outputs[0].token_ids
            == LLM(lm).generate([PROMPTS[0]], params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("damage, words", [
    ("experts", ["num_experts 8", "mlp.experts.8"]),
    ("missing", ["mlp.experts.7", "missing"]),
    ("router", ["mlp.gate.weight", "[8, 64]"]),
])
def test_a_checkpoint_with_another_expert_count_or_router_shape_is_refused_in_one_line(tmp_path, damage, words):
    from safetensors.torch import load_file, save_file

    from unmask.engine.model import load_model

    lm = loaded_llada2(seed=3)
    path = checkpoint_dir(lm, tmp_path / "ckpt")
    state = load_file(str(path / "model.safetensors"))
    if damage == "experts":  # one expert more than config.json says
        for proj in ("gate_proj", "up_proj", "down_proj"):
            state[f"model.layers.1.mlp.experts.8.{proj}.weight"] = state[f"model.layers.1.mlp.experts.0.{proj}.weight"].clone()
    elif damage == "missing":
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del state[f"model.layers.2.mlp.experts.7.{proj}.weight"]
    else:
        state["model.layers.1.mlp.gate.weight"] = state["model.layers.1.mlp.gate.weight"][:6]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_model(str(path), weights="native")
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_refinement_refuses_what_it_cannot_do_and_editing_needs_llada2():
    from tiny import loaded

    lm = loaded_llada2(seed=0)
    llm = LLM(lm)
    for field, extra in (("multi_block", {"multi_block": 0.5}), ("remasking", {"remasking": "margin"}),
                         ("speculative", {"speculative": True})):
        with pytest.raises(ParamError) as err:
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, **extra))
        assert err.value.field == field
    with pytest.raises(ParamError) as err:
        SamplingParams(max_tokens=4, max_post_steps=3)
    assert err.value.field == "max_post_steps"
    with pytest.raises(ParamError) as err:
        LLM(loaded(attention="block_causal")).generate([[5, 6]], SamplingParams(max_tokens=4, editing_threshold=0.5))
    assert err.value.field == "editing_threshold"


def test_config_keys_are_checked_by_name(tmp_path):
    from unmask.engine.families.llada2 import llada2_config

    base = llada2_config_dict(322, 320, 0)
    with pytest.raises(CheckpointError, match="hidden_act"):
        llada2_config({**base, "hidden_act": "gelu"}, tmp_path)
    with pytest.raises(CheckpointError, match="topk_group"):
        llada2_config({**base, "topk_group": 5}, tmp_path)
    json.dumps(base)


def test_a_sampled_request_is_the_same_alone_and_in_a_mixed_batch():
    """Sampled draws are counter-based per (seed, step, position), so a sampled refinement request (with editing)
    gets the same tokens alone and beside others; the pipeline draws with torch.multinomial over its batch, so
    sampled runs are not compared with it."""
    lm = loaded_llada2(seed=2)
    llm = LLM(lm)
    prompt = PROMPTS[1]
    _, greedy = _params(prompt, 8, 4, 0.6, 0.4)
    sampled = SamplingParams(**{**greedy.__dict__, "temperature": 0.9, "top_k": 50, "seed": 11})
    alone = llm.generate([prompt], sampled)[0].outputs[0].token_ids
    mates = [(PROMPTS[0], greedy), (prompt, sampled), (PROMPTS[2], SamplingParams(**{**sampled.__dict__, "seed": 3}))]
    mixed = dict(llm.generate_iter(iter(mates)))
    assert mixed[1].outputs[0].token_ids == alone
    assert alone != llm.generate([prompt], greedy)[0].outputs[0].token_ids

