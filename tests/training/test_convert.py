"""A2D conversion (issue 2, "Conversion"; docs/design.md#decoding, #training and #decisions) on tiny Llama / Qwen2 /
Qwen3 replicas.

What is checked: the mask token is added (or a declared unused one reused) and its id is in ``config.json``; the
vocabulary is resized when needed (tokenizer length == vocabulary size) and not when the vocabulary is padded; the
new rows are the mean rows and every original row is unchanged; the chat template and tied embeddings are kept;
``block_size=1`` decoding with logit shift reproduces the AR parent's greedy output token for token (differences
allowed only at a checked near-tie, docs/design.md#decisions) through the same decoding loop as block 4; the attention
masks take effect; the mask token is never generated; ``unmask convert`` exits 2 with one line on bad values.
"""
from __future__ import annotations

import json

import pytest
import torch

from tiny import CHAT_TEMPLATE, make_llama, make_tokenizer

from unmask.engine import LLM, SamplingParams
from unmask.engine.attention import build_attention_mask, canvas_groups
from unmask.engine.model import load_model
from unmask.training.convert import (ConversionError, convert_checkpoint, plain_copy_of_gguf_model,
                                     resolve_source)

VOCAB = 320  # tokens of the tiny tokenizer (incl. <|endoftext|>, <|im_start|>, <|im_end|>)
NEAR_TIE = 1e-4  # docs/design.md#decisions: a token may differ only where the parent's top-2 logits differ by less


# ------------------------------------------------------------------------------------------------ tiny parents
def make_qwen2(vocab_size: int, seed: int = 0):
    """A tiny random Qwen2ForCausalLM (q/k/v biases, untied head), logits scaled so that argmax is decisive."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # random biases, so that the bias path is exercised
            layer.self_attn.q_proj.bias.normal_(0, 0.1)
            layer.self_attn.k_proj.bias.normal_(0, 0.1)
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def make_qwen3(vocab_size: int, seed: int = 0):
    """A tiny random Qwen3ForCausalLM (q/k norms, explicit head_dim) with TIED embeddings (like Qwen3-0.6B)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=0,
                      pad_token_id=0, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return model.eval()


MAKERS = {"llama": make_llama, "qwen2": make_qwen2, "qwen3": make_qwen3}


def save_parent(path, arch: str, vocab_size: int = VOCAB, tokenizer=None, seed: int = 0):
    tok = tokenizer if tokenizer is not None else make_tokenizer(VOCAB)
    model = MAKERS[arch](vocab_size, seed=seed)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def parents(tmp_path_factory):
    """One saved tiny parent per layout, and its a2d conversions (prefix_causal / block_causal, block_size 4)."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for arch in MAKERS:
        src = save_parent(root / f"{arch}-ar", arch)
        out[arch] = {"src": src}
        for attention in ("prefix_causal", "block_causal"):
            out[arch][attention] = convert_checkpoint(src, root / f"{arch}-{attention}", attention=attention,
                                                      block_size=4, logit_shift=True)
    return out


def parent_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", dtype=torch.float32).eval()


def state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def embed_key(sd):
    return next(k for k in sd if k.endswith("embed_tokens.weight"))


# ------------------------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("arch", list(MAKERS))
def test_mask_token_added_rows_resized_and_initialised(parents, arch):
    src, dst = parents[arch]["src"], parents[arch]["prefix_causal"]
    cfg = json.loads((dst / "config.json").read_text())
    parent_cfg = json.loads((src / "config.json").read_text())
    dllm = cfg["dllm"]
    # tokenizer length == vocabulary size (320): the mask token is a new id and the model grows by one row
    assert dllm["family"] == "a2d" and dllm["mask_token_id"] == VOCAB
    assert dllm["attention"] == "prefix_causal" and dllm["block_size"] == 4 and dllm["logit_shift"] is True
    assert dllm["eos_token_ids"] == [0, 2]  # <|endoftext|> (tokenizer EOS), <|im_end|> (end of turn)
    assert dllm["default_sampling"] == {"temperature": 0.0}
    assert dllm["suppress_token_ids"] == []
    assert cfg["vocab_size"] == VOCAB + 1
    assert cfg["architectures"] == parent_cfg["architectures"] and cfg["model_type"] == parent_cfg["model_type"]
    assert "quantization_config" not in cfg

    lm = load_model(dst, device="cpu", weights="native")
    tok = lm.tokenizer
    assert tok.mask_token == "<|mask|>" and tok.convert_tokens_to_ids("<|mask|>") == VOCAB
    assert len(tok) == VOCAB + 1 and lm.vocab_size == VOCAB + 1
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.encode("a <|mask|> b", add_special_tokens=False).count(VOCAB) == 1  # one special token

    old, new = state(src), state(dst)
    emb = embed_key(old)
    assert new[emb].shape[0] == VOCAB + 1
    torch.testing.assert_close(new[emb][:VOCAB], old[emb], rtol=0, atol=0)  # original rows unchanged
    torch.testing.assert_close(new[emb][VOCAB], old[emb].mean(0), rtol=1e-6, atol=1e-6)  # mask row = mean row
    assert torch.isfinite(new[emb]).all()
    head = lm.model.get_output_embeddings().weight
    if parent_cfg.get("tie_word_embeddings"):
        assert cfg["tie_word_embeddings"] is True
        assert head.data_ptr() == lm.model.get_input_embeddings().weight.data_ptr()
    else:
        torch.testing.assert_close(new["lm_head.weight"][:VOCAB], old["lm_head.weight"], rtol=0, atol=0)
        torch.testing.assert_close(new["lm_head.weight"][VOCAB], old["lm_head.weight"].mean(0), rtol=1e-6, atol=1e-6)
    for k in old:  # every other tensor is the parent's
        if k not in (emb, "lm_head.weight"):
            torch.testing.assert_close(new[k], old[k], rtol=0, atol=0)


def test_padded_vocab_uses_first_free_id_without_resize(tmp_path):
    src = save_parent(tmp_path / "ar", "llama", vocab_size=384)  # 64 padded rows past the tokenizer's 320
    dst = convert_checkpoint(src, tmp_path / "a2d", block_size=4)
    dllm = json.loads((dst / "config.json").read_text())["dllm"]
    assert dllm["mask_token_id"] == VOCAB  # first id no token uses; not an existing token's id
    assert dllm["suppress_token_ids"] == list(range(VOCAB + 1, 384))  # rows no token maps to are never generated
    old, new = state(src), state(dst)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert new[key].shape == old[key].shape == (384, 64)  # no resize
        torch.testing.assert_close(new[key][:VOCAB], old[key][:VOCAB], rtol=0, atol=0)
        torch.testing.assert_close(new[key][VOCAB + 1:], old[key][VOCAB + 1:], rtol=0, atol=0)
        # the mask row is the mean of the REAL tokens' rows (padded rows excluded)
        torch.testing.assert_close(new[key][VOCAB], old[key][:VOCAB].mean(0), rtol=1e-6, atol=1e-6)
    llm = LLM(load_model(dst, device="cpu", weights="native"))
    outs = llm.generate(["The quick brown", "Paris is"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for o in outs:
        ids = o.outputs[0].token_ids
        assert len(ids) == 12 and all(0 <= t < VOCAB for t in ids)


def test_reuses_declared_mask_token(tmp_path):
    tok = make_tokenizer(VOCAB, mask_token="[MASK]")  # tokenizer declares an (unused) mask token: id 320
    src = save_parent(tmp_path / "ar", "llama", vocab_size=len(tok), tokenizer=tok)
    dst = convert_checkpoint(src, tmp_path / "a2d")
    dllm = json.loads((dst / "config.json").read_text())["dllm"]
    assert dllm["mask_token_id"] == VOCAB
    lm = load_model(dst, device="cpu", weights="native")
    assert len(lm.tokenizer) == VOCAB + 1 and lm.vocab_size == VOCAB + 1  # nothing added
    assert lm.tokenizer.mask_token == "[MASK]" and "<|mask|>" not in lm.tokenizer.get_vocab()
    old, new = state(src), state(dst)
    torch.testing.assert_close(new["model.embed_tokens.weight"][VOCAB], old["model.embed_tokens.weight"][:VOCAB].mean(0))


def test_reuses_reserved_special_token(tmp_path):
    from tokenizers import AddedToken

    tok = make_tokenizer(VOCAB)
    tok.add_tokens([AddedToken("<|reserved_special_token_0|>", special=True)], special_tokens=True)
    src = save_parent(tmp_path / "ar", "qwen3", vocab_size=len(tok), tokenizer=tok)
    dst = convert_checkpoint(src, tmp_path / "a2d")
    assert json.loads((dst / "config.json").read_text())["dllm"]["mask_token_id"] == VOCAB
    lm = load_model(dst, device="cpu", weights="native")
    assert lm.tokenizer.mask_token == "<|reserved_special_token_0|>" and lm.vocab_size == VOCAB + 1


def test_reconverting_an_a2d_checkpoint_keeps_its_mask_row(parents, tmp_path):
    first = parents["qwen2"]["prefix_causal"]
    with torch.no_grad():  # pretend training moved the mask row away from the mean
        sd = state(first)
        trained = sd["model.embed_tokens.weight"][VOCAB] + 1.0
    lm = load_model(first, device="cpu", weights="native")
    lm.model.get_input_embeddings().weight.data[VOCAB] = trained
    lm.model.save_pretrained(str(tmp_path / "trained"))
    lm.tokenizer.save_pretrained(str(tmp_path / "trained"))
    again = convert_checkpoint(tmp_path / "trained", tmp_path / "again", attention="bidirectional", block_size=8,
                               logit_shift=False, dtype="bfloat16")
    cfg = json.loads((again / "config.json").read_text())
    assert cfg["dllm"]["mask_token_id"] == VOCAB and cfg["vocab_size"] == VOCAB + 1
    assert (cfg["dllm"]["attention"], cfg["dllm"]["block_size"], cfg["dllm"]["logit_shift"]) == ("bidirectional", 8,
                                                                                                 False)
    new = state(again)
    assert new["model.embed_tokens.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(new["model.embed_tokens.weight"][VOCAB].float(), trained, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------------------ AR parity
def prompts_for(tok):
    chat = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "One two three"}]]
    ids = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids for m in chat]
    ids.append(tok("The quick brown fox", add_special_tokens=False).input_ids)
    return ids


def check_parity(parent, prompt, ar_ids, ours):
    """Token-for-token equality; at the first difference the parent's top-2 logits must be a near-tie (and our
    token one of the two). Returns the number of positions compared."""
    for i, (a, b) in enumerate(zip(ar_ids, ours)):
        if a != b:
            with torch.no_grad():
                logits = parent(torch.tensor([prompt + ar_ids[:i]])).logits[0, -1].float()
            top = logits.topk(2)
            gap = float(top.values[0] - top.values[1])
            assert gap < NEAR_TIE and b in top.indices.tolist(), (
                f"position {i}: AR {a} vs A2D {b}, parent's top-2 gap {gap:.3g} is no near-tie")
            return i
    assert len(ours) == len(ar_ids), f"lengths differ: AR {ar_ids} vs A2D {ours}"
    return len(ours)


@pytest.mark.parametrize("arch", list(MAKERS))
@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal"])
def test_block1_reproduces_ar_parent_through_the_general_loop(parents, arch, attention, monkeypatch):
    from unmask.engine.denoiser import Denoiser

    calls = []
    real_step = Denoiser.step

    def counting_step(self, seqs):
        calls.append([s.block_size for s in seqs])
        return real_step(self, seqs)

    monkeypatch.setattr(Denoiser, "step", counting_step)
    parent = parent_model(parents[arch]["src"])
    lm = load_model(parents[arch][attention], device="cpu", weights="native")
    llm = LLM(lm)
    eos = lm.dllm.eos_token_ids
    n_new = 16
    compared = 0
    for prompt in prompts_for(lm.tokenizer):
        with torch.no_grad():
            gen = parent.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, eos_token_id=eos,
                                  pad_token_id=lm.dllm.pad_token_id, attention_mask=torch.ones(1, len(prompt),
                                                                                               dtype=torch.long))
        ar_ids = gen[0, len(prompt):].tolist()
        calls.clear()
        events = list(llm.stream(prompt, SamplingParams(max_tokens=n_new, temperature=0, block_size=1)))
        ours = llm.generate([prompt], SamplingParams(max_tokens=n_new, temperature=0, block_size=1))[0].outputs[0]
        assert lm.dllm.mask_token_id not in ours.token_ids
        compared += check_parity(parent, prompt, ar_ids, ours.token_ids)
        # the general Sequence/Denoiser loop: one batched Denoiser.step per denoising step, block index == step
        stepped = [e for e in events if e.revealed]
        assert len(calls) == 2 * len(stepped) and all(c == [1] for c in calls)
        assert all(len(e.revealed) == 1 and e.block == e.step for e in stepped)

        # block 4 through the very same loop: a valid output, four tokens revealed per block in 4 steps or in 1
        calls.clear()
        events4 = list(llm.stream(prompt, SamplingParams(max_tokens=n_new, temperature=0, block_size=4,
                                                         ignore_eos=True)))
        stepped4 = [e for e in events4 if e.revealed]
        assert len(calls) == len(stepped4) == n_new and all(c == [4] for c in calls)
        assert [e.block for e in stepped4] == [s // 4 for s in range(n_new)]
        final = [t for t in events4[-1].canvas]
        assert len(final) == n_new and None not in final and lm.dllm.mask_token_id not in final
        calls.clear()
        fast = llm.generate([prompt], SamplingParams(max_tokens=n_new, temperature=0, block_size=4, steps=4,
                                                     ignore_eos=True))[0].outputs[0]
        assert len(calls) == 4 and len(fast.token_ids) == n_new and lm.dllm.mask_token_id not in fast.token_ids
    assert compared >= n_new  # at least one full prompt compared (near-ties are rare)


# ------------------------------------------------------------------------------------------------ masks
def canvas_logits(lm, tokens, attention, P, block):
    """Logits ``[L, V]`` of one no-cache forward of the canvas ``tokens`` with ``[P, P+block)`` as active block."""
    L = len(tokens)
    grp, start, committed = canvas_groups(L, attention, P, P, P + block, block, P)
    pos = torch.arange(L)
    valid = torch.ones(L, dtype=torch.bool)
    mask = build_attention_mask(pos[None], grp[None], start[None], valid[None], pos[None], grp[None],
                                committed[None], valid[None])
    with torch.no_grad():
        h = lm.hidden_states(torch.tensor([tokens]), pos[None], mask)
    return lm.logits(h[0])


def test_attention_masks_take_effect(parents, tmp_path):
    bidir = load_model(convert_checkpoint(parents["llama"]["src"], tmp_path / "bidir", attention="bidirectional"), weights="native",
                       device="cpu")
    causal = load_model(parents["llama"]["prefix_causal"], device="cpu", weights="native")
    m = causal.dllm.mask_token_id
    prompt = causal.tokenizer("The quick brown fox", add_special_tokens=False).input_ids
    P = len(prompt)
    a = prompt + [m, m, m, m]
    b = prompt + [m, m, m, 17]  # a later token (last position of the active block) changes
    # bidirectional: an earlier (prompt) position sees the later token
    la, lb = canvas_logits(bidir, a, "bidirectional", P, 4), canvas_logits(bidir, b, "bidirectional", P, 4)
    assert (la[0] - lb[0]).abs().max() > 1e-3
    # prefix_causal: committed rows are strictly causal (unchanged, bit for bit), the active block is bidirectional
    la, lb = canvas_logits(causal, a, "prefix_causal", P, 4), canvas_logits(causal, b, "prefix_causal", P, 4)
    torch.testing.assert_close(la[:P], lb[:P], rtol=0, atol=0)
    assert (la[P] - lb[P]).abs().max() > 1e-3
    # and the committed rows are exactly the AR parent's causal logits
    parent = parent_model(parents["llama"]["src"])
    with torch.no_grad():
        ar = parent(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(la[:P, :VOCAB], ar, rtol=1e-5, atol=1e-5)


def test_mask_token_is_never_generated(parents):
    lm = load_model(parents["llama"]["prefix_causal"], device="cpu", weights="native")
    m = lm.dllm.mask_token_id
    prompt = lm.tokenizer("One two three four", add_special_tokens=False).input_ids
    with torch.no_grad():  # make [MASK] the model's favourite token everywhere
        h = lm.model.model(torch.tensor([prompt])).last_hidden_state[0]
        lm.model.lm_head.weight[m] = 100.0 * h.mean(0) / h.mean(0).norm()
        raw = lm.model(torch.tensor([prompt])).logits[0]
    assert (raw.argmax(-1) == m).float().mean() > 0.5  # the test can fail: unsuppressed, the mask would win
    llm = LLM(lm)
    for block_size, steps, threshold in ((1, None, None), (4, None, None), (4, 4, None), (8, None, 0.5)):
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, block_size=block_size, steps=steps,
                                                    threshold=threshold, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 16 and m not in out.token_ids
    sampled = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.5, seed=3, ignore_eos=True))
    assert m not in sampled[0].outputs[0].token_ids


# ------------------------------------------------------------------------------------------------ GGUF helpers
def test_gguf_plain_copy_is_serialisable_and_identical():
    model = make_llama(VOCAB, tie_word_embeddings=True)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    plain = plain_copy_of_gguf_model(model)
    assert not hasattr(plain.config, "quantization_config") and type(plain) is type(model)
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()  # still tied
    x = torch.tensor([[5, 9, 33, 2]])
    with torch.no_grad():
        torch.testing.assert_close(plain(x).logits, model(x).logits, rtol=0, atol=0)


def test_resolve_source_finds_gguf_files(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.Q4_1.gguf").write_bytes(b"GGUF")
    assert resolve_source(tmp_path / "one") == (tmp_path / "one", "m.Q4_1.gguf")
    assert resolve_source(tmp_path / "one" / "m.Q4_1.gguf") == (tmp_path / "one", "m.Q4_1.gguf")
    (tmp_path / "one" / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConversionError, match="several GGUF files.*--gguf-file"):
        resolve_source(tmp_path / "one")
    assert resolve_source(tmp_path / "one", "n.gguf") == (tmp_path / "one", "n.gguf")
    with pytest.raises(ConversionError, match="--gguf-file: .*missing.gguf does not exist"):
        resolve_source(tmp_path / "one", "missing.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="neither config.json nor a .gguf"):
        resolve_source(tmp_path / "empty")
    with pytest.raises(ConversionError, match="SRC"):
        resolve_source(tmp_path / "nope")


def test_convert_rejects_bad_arguments(parents, tmp_path):
    src = parents["llama"]["src"]
    with pytest.raises(ConversionError, match="attention"):
        convert_checkpoint(src, tmp_path / "x", attention="causal")
    with pytest.raises(ConversionError, match="block_size"):
        convert_checkpoint(src, tmp_path / "x", block_size=0)
    with pytest.raises(ConversionError, match="OUT: .* not an empty directory"):
        convert_checkpoint(src, parents["llama"]["prefix_causal"])


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_convert(parents, tmp_path, capsys):
    from unmask.cli.main import main

    out = tmp_path / "cli"
    rc = main(["convert", str(parents["qwen2"]["src"]), str(out), "--attention", "block_causal", "--block-size", "2",
               "--no-logit-shift"])
    assert rc == 0
    dllm = json.loads((out / "config.json").read_text())["dllm"]
    assert (dllm["attention"], dllm["block_size"], dllm["logit_shift"]) == ("block_causal", 2, False)
    assert "wrote" in capsys.readouterr().err

    bad = [(["--attention", "causal"], "--attention"), (["--block-size", "0"], "--block-size"),
           (["--block-size", "four"], "--block-size"), (["--dtype", "int3"], "--dtype")]
    for extra, field in bad:
        rc = main(["convert", str(parents["qwen2"]["src"]), str(tmp_path / "bad"), *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and field in err, (extra, err)
    for src, dst, field in ((tmp_path / "missing", tmp_path / "bad", "SRC"), (parents["qwen2"]["src"], out, "OUT")):
        rc = main(["convert", str(src), str(dst)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and field in err, err
    assert not (tmp_path / "bad").exists()
