"""Diffusion draft heads (unmask.engine.draft_head, unmask.training.head_trainer): speculative requests draft with
the head and still answer with the verifier's tokens; the training forward is the decoding forward; a trained head
gets drafts accepted; checkpoints name their head and bad heads are rejected with the file named."""
from __future__ import annotations

import json
import random

import pytest
import torch

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.config import CheckpointError
from unmask.engine.draft_head import DraftHead, DraftHeadConfig, head_rows_mask, load_draft_head
from unmask.engine.model import load_model
from unmask.training.head_config import HeadTrainConfig
from unmask.training.head_trainer import FeatureStore, build_batch, train_head
from unmask.training.trainer import TrainError

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two", "Paris"]


def _random_head(lm, vocab_size=200, window=8, seed=0):
    torch.manual_seed(seed)
    cfg = DraftHeadConfig.from_verifier(lm.model.config, lm.dllm.mask_token_id, draft_vocab_size=vocab_size,
                                        window=window)
    head = DraftHead(cfg, torch.randperm(lm.vocab_size)[:vocab_size])
    head.init_from_verifier(lm.model.model.layers[-1].state_dict(), lm.model.model.norm.weight)
    return head


@pytest.fixture(scope="module")
def with_head(tmp_path_factory):
    lm = tiny.loaded(initializer_range=0.5)
    d = tmp_path_factory.mktemp("head")
    _random_head(lm).save(d / "h")
    lm.draft_head = load_draft_head(d / "h", lm.model, lm.dllm.mask_token_id, lm.device, "test")
    return LLM(lm), LLM(tiny.loaded(initializer_range=0.5))


def _b1(llm, prompt, n, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, block_size=1, speculative=False,
                                               ignore_eos=True, **kw))[0].outputs[0]


@pytest.mark.parametrize("block", [2, 4])
@pytest.mark.parametrize("cache", ["auto", "none"])
def test_head_drafted_output_is_the_greedy_output(with_head, block, cache):
    llm, plain = with_head
    for prompt in PROMPTS:
        for n in (1, 6, 17):
            ref = _b1(plain, prompt, n)
            out = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, block_size=block,
                                                      speculative=True, cache=cache, ignore_eos=True))[0].outputs[0]
            assert out.token_ids == ref.token_ids, (prompt, n)


def test_constrained_greedy_with_head_drafts_is_constrained_block_1(with_head):
    """A grammar holds on the draft-head path too (docs/design.md section 19): head drafts the grammar forbids are
    rejected by the masked verifier rows, so the answer is the constrained block-1 answer."""
    from test_constraints import assert_speculative_constrained_greedy_is_constrained_block_1

    llm, plain = with_head
    assert_speculative_constrained_greedy_is_constrained_block_1(llm, plain)


def test_head_drafts_are_used_and_mask_groups_are_not(with_head):
    """The step forwards only causal rows (no mask groups) and the drafts come from the head."""
    from unmask.engine.speculative import SpeculativeSequence

    llm, _ = with_head
    p = SamplingParams(max_tokens=12, temperature=0, block_size=4, speculative=True, ignore_eos=True)
    ids = llm.tokenizer(PROMPTS[1]).input_ids
    seq = llm.make_sequences(ids, p, "r")[0]
    assert isinstance(seq, SpeculativeSequence) and seq.head is not None and seq.branches == 0
    while not seq.finished:
        lane = seq.lane_inputs()[0]
        assert not bool((lane.tokens == llm.model.dllm.mask_token_id).any())
        assert lane.feature_rows is not None
        llm.denoiser.step([seq])
        if not seq.finished:
            assert len(seq.drafts) == min(3, seq.end - seq.final_len - 1)
    assert seq.proposed_drafts > 0


def test_fallback_branches_with_a_head_are_refused_by_name(with_head):
    """With a draft head a step forwards no fallback mask groups, so speculative_branches > 0 had no effect (it was
    ignored): a 400-style ParamError naming it; 0 (what happens) and no value are served, and without a head the
    same request uses its branches."""
    from unmask.engine import ParamError
    from unmask.engine.speculative import SpeculativeSequence

    llm, plain = with_head
    ids = llm.tokenizer(PROMPTS[1]).input_ids
    for kw in ({}, {"temperature": 0.7}, {"cache": "none"}):
        p = SamplingParams.from_flat(**{"max_tokens": 8, "block_size": 4, "speculative": True, **kw},
                                     speculative_branches=2)
        with pytest.raises(ParamError) as err:
            llm.make_sequences(ids, p, "r")
        assert err.value.field == "speculative_branches" and "draft head" in str(err.value), kw
        assert plain.make_sequences(ids, p, "r")[0].branches == 2
    for b in (0, None):
        seq = llm.make_sequences(ids, SamplingParams.from_flat(max_tokens=8, block_size=4, speculative=True,
                                                               speculative_branches=b), "r")[0]
        assert isinstance(seq, SpeculativeSequence) and seq.head is not None and seq.branches == 0


def test_sampling_with_a_head_is_seeded_and_valid(with_head):
    llm, _ = with_head
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=5, block_size=4, speculative=True,
                       ignore_eos=True)
    a = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
    b = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
    assert a == b and len(a) == 16 and all(0 <= t < llm.model.vocab_size for t in a)


def test_speculative_sampling_with_a_head_keeps_the_distribution():
    """Speculative sampling stays exact with head drafts: the first generated token's distribution matches
    block_size=1 sampling (chi-square style bound over many seeds on a 2-token answer)."""
    lm = tiny.loaded(initializer_range=0.05, vocab_size=64)
    head = _random_head(lm, vocab_size=40, window=4)
    lm.draft_head = None
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    head.save(d / "h")
    with_h = tiny.loaded(initializer_range=0.05, vocab_size=64)
    with_h.draft_head = load_draft_head(d / "h", with_h.model, with_h.dllm.mask_token_id, with_h.device, "t")
    spec, plain = LLM(with_h), LLM(lm)
    N = 300
    counts_spec, counts_ref = {}, {}
    for s in range(N):
        t1 = spec.generate("Hi", SamplingParams(max_tokens=3, temperature=1.0, seed=s, block_size=4,
                                                speculative=True, ignore_eos=True))[0].outputs[0].token_ids
        t2 = plain.generate("Hi", SamplingParams(max_tokens=3, temperature=1.0, seed=10_000 + s, block_size=1,
                                                 speculative=False, ignore_eos=True))[0].outputs[0].token_ids
        counts_spec[t1[1]] = counts_spec.get(t1[1], 0) + 1  # the second token: drafted by the head, verified
        counts_ref[t2[1]] = counts_ref.get(t2[1], 0) + 1
    keys = set(counts_spec) | set(counts_ref)
    tv = 0.5 * sum(abs(counts_spec.get(k, 0) - counts_ref.get(k, 0)) for k in keys) / N
    assert tv < 0.2, tv  # two samples of one distribution; a biased rule (e.g. accepting every draft) is far off


def test_head_rows_mask():
    m = head_rows_mask(torch.tensor([3]), torch.tensor([2]), 6, window=2)[0]
    # context rows: causal within the window of 2
    assert m[0].tolist()[:3] == [True, False, False]
    assert m[2].tolist()[:3] == [False, True, True]
    # draft rows: the last 2 context rows and both draft rows, not the older context row, not padding
    assert m[3].tolist() == [False, True, True, True, True, False]
    assert m[4].tolist() == [False, True, True, True, True, False]
    assert m[5].tolist() == [False, False, False, False, False, True]


def test_head_save_is_atomic_and_load_checks_files(tmp_path):
    lm = tiny.loaded()
    head = _random_head(lm)
    head.save(tmp_path / "h")
    again = DraftHead.load(tmp_path / "h")
    for (k, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    (tmp_path / "h" / "config.json").write_text('{"hidden_size": 64,\n "oops"}')
    with pytest.raises(CheckpointError, match=r"config.json:2:\d+: invalid JSON"):
        DraftHead.load(tmp_path / "h")
    head.save(tmp_path / "h")  # overwrite the broken head atomically
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["window"] = 0
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="window"):
        DraftHead.load(tmp_path / "h")
    head.save(tmp_path / "h")
    (tmp_path / "h" / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        DraftHead.load(tmp_path / "h")


def test_checkpoint_names_its_head_and_bad_heads_are_named(tmp_path):
    lm = tiny.loaded(initializer_range=0.5)
    lm.dllm.draft_head = "draft_head"
    write_checkpoint(tmp_path / "m", lm.model, lm.tokenizer, lm.dllm)
    with pytest.raises(CheckpointError, match="dllm.draft_head"):
        load_model(tmp_path / "m", device="cpu")  # the directory is missing
    _random_head(lm).save(tmp_path / "m" / "draft_head")
    loaded = load_model(tmp_path / "m", device="cpu")
    assert loaded.draft_head is not None
    plain = LLM(tiny.loaded(initializer_range=0.5))
    out = LLM(loaded).generate(PROMPTS[0], SamplingParams(max_tokens=9, temperature=0, speculative=True,
                                                          ignore_eos=True))[0].outputs[0]
    assert out.token_ids == _b1(plain, PROMPTS[0], 9).token_ids
    cfg = json.loads((tmp_path / "m" / "draft_head" / "config.json").read_text())
    cfg["mask_token_id"] = 1
    (tmp_path / "m" / "draft_head" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="dllm.draft_head.*mask_token_id"):
        load_model(tmp_path / "m", device="cpu")


def test_bidirectional_checkpoint_cannot_name_a_head():
    from unmask.engine.config import DllmConfig

    with pytest.raises(CheckpointError, match="draft_head: needs prefix_causal"):
        DllmConfig(family="a2d", mask_token_id=1, attention="bidirectional", block_size=4, logit_shift=False,
                   eos_token_ids=[0], draft_head="draft_head")


# ------------------------------------------------------------------ training

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny verifier, its own greedy answers as data, and a head trained on them for a few hundred steps."""
    d = tmp_path_factory.mktemp("train_head")
    lm = tiny.loaded(initializer_range=0.5)
    write_checkpoint(d / "verifier", lm.model, lm.tokenizer, lm.dllm)
    llm = LLM(lm)
    rows = []
    rng = random.Random(0)
    words = ["red", "blue", "cat", "dog", "one", "two", "sun", "moon", "tree", "sea"]
    for i in range(24):
        prompt = " ".join(rng.choice(words) for _ in range(4))
        out = llm.generate(lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                            add_generation_prompt=True, tokenize=False),
                           SamplingParams(max_tokens=20, temperature=0, block_size=1, speculative=False))
        o = out[0].outputs[0]  # completion_ids: the generated tokens as they are (distill-data rows)
        rows.append({"prompt": prompt, "completion": o.text, "completion_ids": o.token_ids})
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = HeadTrainConfig(verifier=str(d / "verifier"), data=str(d / "data.jsonl"), out=str(d / "out"),
                          minutes=0, max_steps=150, batch_size=8, lr=3e-3, warmup=5, window=8, groups=8,
                          draft_vocab_size=120, save_every=100, seq_len=64, val_docs=0)
    train_head(cfg, log=lambda *_: None)
    return d, cfg, rows


def test_trained_head_gets_drafts_accepted_and_keeps_the_tokens(trained):
    d, cfg, rows = trained
    loaded = load_model(d / "out", device="cpu")
    plain = LLM(load_model(d / "verifier", device="cpu"))
    llm = LLM(loaded)
    msgs = [{"role": "user", "content": rows[0]["prompt"]}]
    ids = llm.apply_chat_template(msgs)
    ref = plain.generate(ids, SamplingParams(max_tokens=20, temperature=0, block_size=1, speculative=False))
    seq = llm.make_sequences(ids, SamplingParams(max_tokens=20, temperature=0, block_size=4, speculative=True),
                             "r")[0]
    while not seq.finished:
        llm.denoiser.step([seq])
    assert seq.canvas[seq.prompt_len: seq.final_len].tolist() == ref[0].outputs[0].token_ids
    assert seq.accepted_drafts / max(1, seq.proposed_drafts) > 0.3  # a random head accepts ~none
    assert seq.nfe < len(ref[0].outputs[0].token_ids)


def test_training_forward_is_the_decoding_forward(trained):
    """Logits of the training layout equal the runtime head's for the same context and draft block."""
    from unmask.training.data import load_dataset

    d, cfg, _ = trained
    loaded = load_model(d / "out", device="cpu", weights="native")
    rt = loaded.draft_head
    ds = load_dataset(cfg.data, loaded.tokenizer, cfg.seq_len, set(loaded.dllm.eos_token_ids))
    ex = ds.examples[0]
    x = torch.tensor(ex.input_ids)
    with torch.no_grad():
        h = loaded.model.base_model(input_ids=x[None]).last_hidden_state[0]
    store = FeatureStore([x], [torch.tensor(ex.answer)], [h.to(torch.bfloat16)])
    V = loaded.vocab_size
    vocab_index = torch.full((V,), -1, dtype=torch.long)
    vocab_index[rt.vocab] = torch.arange(rt.vocab.numel())
    one = HeadTrainConfig(verifier="", data="", out="", groups=1, window=cfg.window, max_drafts=3)
    for seed in range(6):
        batch = build_batch(store, [0], one, loaded.dllm.mask_token_id, vocab_index, random.Random(seed))
        with torch.no_grad():
            hid = rt.head(batch["features"], batch["tokens"], batch["positions"], batch["mask"], rt.embedding)[0]
        n_ctx = int(batch["is_ctx"][0].sum())
        grp_pos = batch["positions"][0, n_ctx:]
        grp_pos = grp_pos[grp_pos > 0]
        c = int(grp_pos[0]) - 1
        # runtime forward: context pairs of positions c - W + 1 .. c, then the same draft rows
        lo = max(1, c - cfg.window + 1)
        feats = torch.cat((h[lo - 1: c].float(), torch.zeros(len(grp_pos), h.shape[1])))
        toks = torch.cat((x[lo: c + 1], batch["tokens"][0, n_ctx: n_ctx + len(grp_pos)]))
        pos = torch.cat((torch.arange(lo, c + 1), grp_pos))
        W = c + 1 - lo
        mask = head_rows_mask(torch.tensor([W]), torch.tensor([len(grp_pos)]), W + len(grp_pos), cfg.window)
        with torch.no_grad():
            run = rt.head(feats.to(torch.bfloat16).float()[None], toks[None], pos[None], mask, rt.embedding)[0]
        train_rows = torch.cat((torch.tensor([c - 1]), torch.arange(n_ctx, n_ctx + len(grp_pos))))
        run_rows = torch.cat((torch.tensor([W - 1]), torch.arange(W, W + len(grp_pos))))
        torch.testing.assert_close(hid[train_rows], run[run_rows], atol=1e-4, rtol=1e-4)


def test_train_head_resumes_and_rejects_bad_options(trained, tmp_path):
    d, cfg, _ = trained
    state = json.loads((d / "out" / "head_train" / "state.json").read_text())
    assert state["step"] == 150
    more = HeadTrainConfig(**{**cfg.__dict__, "max_steps": 160})
    lines = []
    train_head(more, log=lines.append)
    assert any("resuming at step 150" in ln for ln in lines)
    assert json.loads((d / "out" / "head_train" / "state.json").read_text())["step"] == 160
    with pytest.raises(TrainError, match="--window"):
        train_head(HeadTrainConfig(**{**cfg.__dict__, "window": 0}))
    other = tiny.loaded(attention="bidirectional", logit_shift=False)
    write_checkpoint(tmp_path / "bidir", other.model, other.tokenizer, other.dllm)
    with pytest.raises(TrainError, match="--verifier.*prefix_causal"):
        train_head(HeadTrainConfig(**{**cfg.__dict__, "verifier": str(tmp_path / "bidir"),
                                      "out": str(tmp_path / "o")}))


def test_export_carries_the_head(trained, tmp_path):
    from unmask.training.export import export

    d, _, _ = trained
    res = export(str(d / "out"), str(tmp_path / "exp"), "none", verify=True)
    assert res["draft_head"] and (tmp_path / "exp" / "draft_head" / "model.safetensors").is_file()
    cfg = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert cfg["dllm"]["draft_head"] == "draft_head" and cfg["dllm"]["default_sampling"]["speculative"] is True
    assert load_model(tmp_path / "exp", device="cpu").draft_head is not None


def test_held_out_documents_are_scored_at_every_save(trained, tmp_path):
    d, cfg, _ = trained
    lines = []
    run = HeadTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "o"), "max_steps": 6, "save_every": 3,
                             "val_docs": 4})
    train_head(run, log=lines.append)
    val = (tmp_path / "o" / "head_train" / "val.csv").read_text().splitlines()
    assert val[0] == "step,val_loss,val_acc_first,val_acc_later"
    assert [ln.split(",")[0] for ln in val[1:]] == ["3", "6"]  # every save (the last one included), once
    assert sum("held-out (4 documents)" in ln for ln in lines) == 2


def test_targets_all_trains_on_the_verifiers_greedy_tokens_everywhere(trained, tmp_path):
    """--targets all: every position (prompt included) learns the verifier's own argmax after it; on the greedy
    answers those are the answer tokens themselves."""
    from unmask.training.data import load_dataset

    d, cfg, _ = trained
    loaded = load_model(d / "verifier", device="cpu", weights="native")
    ds = load_dataset(cfg.data, loaded.tokenizer, cfg.seq_len, set(loaded.dllm.eos_token_ids))
    ex = ds.examples[0]
    x = torch.tensor(ex.input_ids)
    with torch.no_grad():
        h = loaded.model.base_model(input_ids=x[None]).last_hidden_state[0]
    store = FeatureStore([x], [torch.tensor(ex.answer)], [h.to(torch.bfloat16)])
    store.add_greedy(loaded.model.get_output_embeddings())
    a = torch.tensor(ex.answer)
    g = store.greedy[0]
    assert torch.equal(g[:-1][a[1:]][:-1], x[1:][a[1:]][:-1])  # greedy answers: the argmax is the next token
    V = loaded.vocab_size
    vocab_index = torch.arange(V)
    one = HeadTrainConfig(verifier="", data="", out="", groups=2, window=cfg.window, targets="all")
    batch = build_batch(store, [0], one, loaded.dllm.mask_token_id, vocab_index, random.Random(0))
    n_ctx = int(batch["is_ctx"][0].sum())
    assert torch.equal(batch["targets"][0, :n_ctx], g[1:])  # context row of position t: the argmax after t
    run = HeadTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "o"), "max_steps": 3, "targets": "all"})
    train_head(run, log=lambda *_: None)
    with pytest.raises(TrainError, match="--targets"):
        train_head(HeadTrainConfig(**{**cfg.__dict__, "targets": "some"}))


def test_drafting_reveals_contiguous_runs_only(with_head):
    """A draft is never revealed before an earlier one (speculative sampling needs draft i drawn given drafts < i):
    with a confident third draft behind an unsure second one, the second is decided first."""
    llm, _ = with_head
    rt = llm.model.draft_head
    K = rt.vocab.numel()
    calls = []

    def fake_lm(hidden):  # row j: peaked when j is even, uniform when odd
        calls.append(hidden.shape[0])
        out = torch.zeros(hidden.shape[0], K)
        out[0::2, 0] = 50.0
        return out

    saved = rt._lm
    rt._lm = fake_lm
    try:
        H = rt.cfg.hidden_size
        ids, _ = rt.draft(torch.randn(4, H), torch.tensor([5, 6, 7, 8]), torch.tensor([1, 2, 3, 4]), 3,
                          lambda lg: (lg.argmax(-1), None), threshold=0.9)
        assert calls == [3, 2, 1] and len(ids) == 3  # old rule (any confident draft): [3, 1]
        calls.clear()
        rt.draft(torch.randn(4, H), torch.tensor([5, 6, 7, 8]), torch.tensor([1, 2, 3, 4]), 3,
                 lambda lg: (lg.argmax(-1), None), threshold=0.0)
        assert calls == [3]  # threshold 0: every draft in one head forward
    finally:
        rt._lm = saved


def test_resume_rejects_other_head_shapes(trained):
    d, cfg, _ = trained
    for name, value in (("window", 3), ("max_drafts", 5), ("draft_vocab_size", 90)):
        with pytest.raises(TrainError, match=f"--{name.replace('_', '-')}: .* differs from the head being resumed"):
            train_head(HeadTrainConfig(**{**cfg.__dict__, name: value, "max_steps": 500}))
    with pytest.raises(TrainError, match="--num-layers"):
        train_head(HeadTrainConfig(**{**cfg.__dict__, "num_layers": 2}))


def test_draft_vocabulary_never_holds_never_generated_ids():
    """With fewer seen tokens than draft-vocabulary slots, zero-count ids fill it; the mask token and the other
    never-generated ids must not be among them (a draft of one is always rejected), EOS ids always are."""
    from unmask.engine.draft_head import draft_vocab_from_counts

    counts = torch.zeros(10, dtype=torch.long)
    counts[[1, 4]] = torch.tensor([5, 3])
    vocab = draft_vocab_from_counts(counts, 8, always=[0], never=[9, 8])
    assert vocab.tolist() == sorted(vocab.tolist()) and {0, 1, 4} <= set(vocab.tolist())
    assert not {8, 9} & set(vocab.tolist()) and len(vocab) == 8
    with pytest.raises(ValueError, match="never-generated"):
        draft_vocab_from_counts(counts, 9, always=[0], never=[9, 8])
