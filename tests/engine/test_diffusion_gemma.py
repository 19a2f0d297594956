"""DiffusionGemma (issue 43): a tiny random checkpoint in transformers' own layout decodes token for token as
``DiffusionGemmaForBlockDiffusion.generate()`` at batch 1 with the same seed, alone and inside a mixed batch
(other prompts, options, choices joining mid-flight), over seeds, step counts, temperature schedules and stopping
settings; what the sampler does not do is refused naming the field."""
from __future__ import annotations

import pytest
import torch

from diffusion_gemma_tiny import EOS, reference_generate, save_replica
from unmask.engine.limits import ParamError
from unmask.engine.llm import LLM
from unmask.engine.model import load_model
from unmask.engine.params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]
LOW_T = dict(t_min=0.05, t_max=0.1, entropy_bound=1000.0)  # near-argmax canvases that settle: stopping fires
CASES = [  # (prompt, seed, options): transformers' generation-config names
    (0, 1, dict(max_denoising_steps=6)),  # the defaults' schedule and bound
    (1, 2, dict(max_denoising_steps=6)),
    (2, 3, dict(max_denoising_steps=12, t_min=1.0, t_max=2.0, entropy_bound=0.5)),
    (0, 1, dict(max_denoising_steps=12, confidence_threshold=10.0, **LOW_T)),  # stable for 1 step
    (0, 2, dict(max_denoising_steps=12, confidence_threshold=0.5, stability_threshold=2, **LOW_T)),  # EOS
    (3, 4, dict(max_denoising_steps=4, stability_threshold=0, confidence_threshold=10.0, entropy_bound=2.0)),
    (1, 5, dict(max_denoising_steps=3, t_min=0.2, t_max=0.3)),
]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion_gemma")
    save_replica(path, canvas_length=8)
    return load_model(str(path), device="cpu")


def _reference(model, case) -> list[int]:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    prompt, seed, opts = case
    kw = dict(opts)
    if "entropy_bound" in kw:
        kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=kw.pop("entropy_bound"))
    return reference_generate(model, PROMPTS[prompt], seed, max_new_tokens=24, **kw)


def _run(llm: LLM, cases) -> list:
    reqs = [(PROMPTS[p], SamplingParams(max_tokens=24, seed=seed, **opts)) for p, seed, opts in cases]
    out = dict(llm.generate_iter(reqs, lookahead=len(reqs)))
    return [out[i].outputs[0] for i in range(len(reqs))]


def test_a_loaded_checkpoint_is_the_family_with_its_canvas_as_the_block(replica):
    d = replica.dllm
    assert (d.family, d.block_size, d.fixed_block_size, d.eos_token_ids) == ("diffusion_gemma", 8, True, [EOS])
    assert d.mask_token_id == replica.vocab_size  # no mask token: a sentinel no id can be
    assert replica.weight_format == "native"  # served as loaded


def test_alone_and_in_a_mixed_batch_equal_generate_at_batch_1(replica):
    refs = [_reference(replica.model, c) for c in CASES]
    alone = [_run(LLM(replica), [c])[0] for c in CASES]
    mixed = _run(LLM(replica, max_batch_size=3), CASES)  # 7 choices through 3 slots: choices join mid-flight
    for case, ref, a, m in zip(CASES, refs, alone, mixed):
        assert a.token_ids == ref, case
        assert m.token_ids == ref, case
    # not vacuous: adaptive stopping ended canvases early, an EOS ended a choice, others ran to max_tokens
    steps = [max(c[2]["max_denoising_steps"], 1) for c in CASES]
    assert any(min(o.steps_per_block) < s for o, s in zip(alone, steps))
    assert any(o.finish_reason == "stop" and o.token_ids[-1] == EOS for o in alone)
    assert any(o.finish_reason == "length" and len(o.token_ids) == 24 for o in alone)
    assert len({tuple(r) for r in refs}) == len(refs)


def test_n_choices_take_seed_and_seed_plus_one(replica):
    out = LLM(replica).generate([PROMPTS[0]], SamplingParams(max_tokens=16, seed=1, max_denoising_steps=6), n=2)
    got = [o.token_ids for o in out[0].outputs]
    assert got == [_reference(replica.model, (0, s, dict(max_denoising_steps=6)))[:16] for s in (1, 2)]


def test_stop_strings_and_max_tokens_cut_the_final_text(replica):
    llm = LLM(replica)
    full = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, seed=1, max_denoising_steps=6))[0].outputs[0]
    cut = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, seed=1, max_denoising_steps=6))[0].outputs[0]
    assert cut.token_ids == full.token_ids[:5] and cut.finish_reason == "length"
    stop = full.text[3:6]
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, seed=1, max_denoising_steps=6,
                                                        stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and full.text.startswith(stopped.text) and stop not in stopped.text


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.7), ("top_p", 0.5), ("top_k", 5), ("min_tokens", 2), ("logprobs", True), ("steps", 4),
    ("threshold", 0.9), ("presence_penalty", 0.5), ("cfg_scale", 1.0), ("block_size", 4), ("t_max", 0.3),
    ("speculative_epsilon", 0.1),
])
def test_what_the_sampler_does_not_do_is_refused_naming_the_field(replica, field, value):
    kw = {field: value, **({"t_min": 0.3} if field == "t_max" else {})}
    with pytest.raises(ParamError) as err:
        LLM(replica).generate([PROMPTS[0]], SamplingParams.from_flat(max_tokens=8, **kw))
    assert err.value.field == field


def test_the_samplers_options_on_another_family_are_refused_naming_the_field():
    from tiny import loaded

    with pytest.raises(ParamError) as err:
        LLM(loaded()).generate([[5, 6]], SamplingParams(max_tokens=4, entropy_bound=0.3))
    assert err.value.field == "entropy_bound"


def test_an_older_transformers_is_refused_naming_the_version(monkeypatch, tmp_path):
    import transformers

    from unmask.engine.config import CheckpointError
    from unmask.engine.families.diffusion_gemma import require_transformers

    monkeypatch.setattr(transformers, "__version__", "5.24.1")
    with pytest.raises(CheckpointError, match=r"transformers >= 5\.25.*5\.24\.1"):
        require_transformers()


def test_the_stream_shows_the_canvas_changing_before_it_is_final(replica):
    from unmask.engine.engine import Engine

    engine = Engine(replica)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=16, seed=1, max_denoising_steps=6), "r")
    events = []
    while engine.has_unfinished():
        events += engine.step()
    provisional = [e for e in events if e.final is not None]
    assert provisional and all(e.final % 8 == 0 for e in provisional)
    changed = sum(a.canvas[i] != b.canvas[i] for a, b in zip(provisional, provisional[1:])
                  for i in range(b.final, 16) if a.final == b.final)
    assert changed, "the argmax canvas never changed between steps: the check would be vacuous"
    texts = [e.text for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # the final text only grows
    assert events[-1].finished and events[-1].final is None
    ref = _reference(replica.model, (0, 1, dict(max_denoising_steps=6)))[:16]
    assert events[-1].output.token_ids == ref
    assert torch.equal(torch.tensor(events[-1].canvas), torch.tensor(ref))


def test_the_servers_first_forward_check_runs_the_encoder_and_the_decoder(replica):
    from unmask.engine.self_check import check_first_forward

    check_first_forward(replica)  # `unmask serve` runs it before accepting requests (the mask rows would not exist)


def test_a_chats_next_turn_reuses_the_encoders_kv_and_decodes_the_same_tokens(replica):
    """Encoder KV reuse (engine/encoder_prefix.py): the next turn's prompt starts with the last turn's, so it encodes
    only what was added; its tokens are those of a fresh encode (and of generate()); n choices encode once."""
    opts = dict(max_tokens=16, seed=4, max_denoising_steps=6)
    llm = LLM(replica)
    first = llm.generate([PROMPTS[2]], SamplingParams(**opts))[0].outputs[0]
    turn = PROMPTS[2] + first.token_ids + [40, 41, 42]
    again = llm.generate([turn], SamplingParams(**opts), n=2)[0].outputs
    store = llm.denoiser.encoder_store
    assert len(first.token_ids) == 16  # two whole canvases: the first one was encoded (the last never is)
    # the last turn's prompt and first canvas, then (the second choice) the whole prompt
    assert store.hits == 2 and store.tokens == len(PROMPTS[2]) + 8 + len(turn)
    fresh = LLM(replica, enable_prefix_caching=False)
    assert fresh.denoiser.encoder_store is None
    expected = [o.token_ids for o in fresh.generate([turn], SamplingParams(**opts), n=2)[0].outputs]
    assert [o.token_ids for o in again] == expected
    torch.manual_seed(4)
    ref = replica.model.generate(torch.tensor([turn]), max_new_tokens=16, max_denoising_steps=6)
    assert again[0].token_ids == ref.sequences[0, len(turn):].tolist()[: len(again[0].token_ids)]



def test_the_batchs_stacked_encoder_kv_is_reused_until_a_choice_joins_leaves_or_encodes(replica):
    """engine/uniform_canvas.py's _StackedCache: built once per batch composition (docs/design.md#decoding, "Uniform
    canvas"), reused while the same choices step with the same caches; a stale one would feed a choice another
    canvas's keys, so the tokens are checked against generate() too."""
    from unmask.engine.engine import Engine

    engine = Engine(replica)
    cases = [CASES[0], (2, 3, dict(max_denoising_steps=6))]  # prompts of 5 and 11 tokens: padded, masked keys
    for i, (p, seed, opts) in enumerate(cases):
        engine.add_request(PROMPTS[p], SamplingParams(max_tokens=24, seed=seed, **opts), f"r{i}")
    steps, outputs = [], {}
    while engine.has_unfinished():
        for e in engine.step():
            if e.finished:
                outputs[e.request_id] = e.output.token_ids
        running = list(engine.scheduler.running)
        if len(running) == 2:
            steps.append(([s.kv_version for s in running], running[0].stacked))
            assert running[1].stacked is running[0].stacked and running[0].stacked.fits(running)
    reused = rebuilt = 0
    for (versions, stacked), (before, last) in zip(steps[1:], steps):
        same = all(a is b for a, b in zip(versions, before))
        assert (stacked is last) == same, "a stacked cache must be reused exactly while no choice encodes"
        reused, rebuilt = reused + same, rebuilt + (not same)
    assert reused >= 10 and rebuilt == 2  # 3 canvases of 8 at 6 steps each: encodes at the 7th and 13th steps
    assert [outputs["r0"], outputs["r1"]] == [_reference(replica.model, c) for c in cases]


def test_the_start_up_line_describes_the_uniform_canvas_not_masks(tmp_path):
    """``default decoding:`` on a DiffusionGemma model names its canvas, steps and sampler settings (it said "one
    token per step, block 16 and remasking low_confidence", which a request sending remasking gets a 400 for)."""
    from diffusion_gemma_tiny import save_replica
    from unmask.engine.engine import Engine
    from unmask.engine.model import load_model

    save_replica(tmp_path, canvas_length=8)
    line = Engine(load_model(str(tmp_path), device="cpu")).describe_defaults()
    assert line.startswith("uniform canvases of 8 tokens refined for at most 48 steps each"), line
    assert "remasking" not in line and "block" not in line
