"""The ``draft`` training objective: the drafter of verifier-routed speculative decoding (unmask.engine.routed) is
trained on exactly the forward that decoding runs - verifier keys/values as context, fully masked draft groups."""
from __future__ import annotations

import json

import pytest
import torch

import tiny
from unmask.engine.checkpoint import write_checkpoint
from unmask.engine.llm import LLM
from unmask.engine.params import SamplingParams
from unmask.training.data import collate, load_dataset
from unmask.training.losses import accepted_draft_length, build_draft_layout
from unmask.training.forwards import DraftForward
from unmask.training.trainer import TrainConfig, TrainError, train

DATA = [
    {"prompt": "What is two plus two?", "completion": "Two plus two is four."},
    {"prompt": "Name a quick animal.", "completion": "The quick brown fox."},
    {"prompt": "Capital of France?", "completion": "Paris is the capital of France."},
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    for name, seed in (("parent", 0), ("drafter", 1)):
        lm = tiny.loaded(seed=seed, initializer_range=0.5)
        write_checkpoint(d / name, lm.model, lm.tokenizer, lm.dllm)
    with open(d / "data.jsonl", "w") as fh:
        for x in DATA:
            fh.write(json.dumps(x) + "\n")
    return d


def _batch(tok, dllm):
    ds = load_dataset_from(tok, dllm)
    return collate(ds.examples, dllm.pad_token_id)


def load_dataset_from(tok, dllm):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in DATA))
    return load_dataset(path, tok, 64, set(dllm.eos_token_ids))


def test_layout_masks_labels_and_groups():
    lm = tiny.loaded()
    batch = _batch(lm.tokenizer, lm.dllm)
    lay = build_draft_layout(batch, lm.dllm, 4, torch.Generator().manual_seed(0), max_groups=1000)
    B, L = batch.input_ids.shape
    assert lay.attention_mask.shape == (B, 1, lay.input_ids.shape[1], L + lay.input_ids.shape[1])
    assert bool((lay.input_ids[lay.valid] == lm.dllm.mask_token_id).all())
    for b in range(B):
        (lo, hi), = batch.spans[b]
        starts = sorted(set(lay.position_ids[b, lay.valid[b]].tolist()[::4]))
        assert starts == list(range(lo, hi - 1))  # every answer position with a label after it
        for r in range(lay.input_ids.shape[1]):
            if not lay.valid[b, r]:
                continue
            s = int(lay.position_ids[b, r - r % 4])
            allowed = lay.attention_mask[b, 0, r]
            ctx = allowed[:L]
            assert ctx.tolist() == [bool(j < s and batch.valid[b, j]) for j in range(L)]
            own = allowed[L:].nonzero().flatten().tolist()
            assert own == list(range(r - r % 4, r - r % 4 + 4))  # its own group, bidirectionally
    for i in range(lay.labels.numel()):
        b, c, k = int(lay.src_row[i]), int(lay.src_col[i]), int(lay.draft_index[i])
        s = int(lay.position_ids[b, c]) - k
        assert c % 4 == k and int(lay.labels[i]) == int(batch.input_ids[b, s + k + 1])
        assert s + k + 1 < batch.spans[b][0][1]


def test_layout_caps_groups_and_rejects_bad_settings():
    lm = tiny.loaded()
    batch = _batch(lm.tokenizer, lm.dllm)
    lay = build_draft_layout(batch, lm.dllm, 3, torch.Generator().manual_seed(0), max_groups=2)
    assert int(lay.valid.sum(1).max()) == 2 * 3
    with pytest.raises(ValueError, match="at least 2"):
        build_draft_layout(batch, lm.dllm, 1, torch.Generator())
    bidir = tiny.loaded(attention="bidirectional")
    with pytest.raises(ValueError, match="prefix_causal"):
        build_draft_layout(batch, bidir.dllm, 4, torch.Generator())


def test_accepted_length_counts_leading_hits():
    lm = tiny.loaded()
    batch = _batch(lm.tokenizer, lm.dllm)
    lay = build_draft_layout(batch, lm.dllm, 4, torch.Generator().manual_seed(0), max_groups=3)
    V = 400
    perfect = torch.nn.functional.one_hot(lay.labels, V).float()
    full = sum(min(3, int((lay.group == g).sum())) for g in lay.group.unique().tolist()) / lay.group.unique().numel()
    assert accepted_draft_length(perfect, lay) == pytest.approx(full)
    first_wrong = perfect.clone()
    first_wrong[lay.draft_index == 0] = torch.roll(first_wrong[lay.draft_index == 0], 1, dims=-1)
    assert accepted_draft_length(first_wrong, lay) == 0.0


def test_training_forward_equals_the_decoding_forward():
    """DraftForward's logits for a draft group = the routed engine model's logits for the same rows (the verifier's
    causal context, then one fully masked group seeing the context before its start)."""
    routed, verifier = tiny.loaded_with_verifier(initializer_range=0.5)
    drafter = tiny.loaded(seed=1, initializer_range=0.5)
    batch = _batch(routed.tokenizer, routed.dllm)
    lay = build_draft_layout(batch, routed.dllm, 4, torch.Generator().manual_seed(0), max_groups=3)

    class TM:  # what DraftForward reads from a TrainModel
        model = drafter.model
        base = drafter.model

    with torch.no_grad():
        got = DraftForward(TM(), verifier.model)(lay.context_ids, lay.context_mask, lay.input_ids, lay.position_ids,
                                                  lay.attention_mask, lay.src_row, lay.src_col)
    from unmask.engine.attention import build_attention_mask

    for i in range(0, lay.labels.numel(), 5):
        b, c = int(lay.src_row[i]), int(lay.src_col[i])
        g0 = c - c % 4
        s = int(lay.position_ids[b, g0])
        ids = torch.cat([batch.input_ids[b, :s], torch.full((4,), routed.dllm.mask_token_id)])[None]
        pos = torch.arange(s + 4)[None]
        grp = torch.cat([torch.arange(s), torch.full((4,), 10_000)])[None]
        start = torch.cat([torch.arange(s), torch.full((4,), s)])[None]
        com = torch.cat([torch.ones(s, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)])[None]
        ok = torch.ones_like(com)
        mask = build_attention_mask(pos, grp, start, ok, pos, grp, com, ok)
        with torch.no_grad():
            h = routed.hidden_states(ids, pos, mask, drafter_rows=~com)
            want = routed.logits(h[0, s + (c - g0)][None], drafter_rows=torch.tensor([True]))
        assert torch.allclose(got[i], want[0], atol=1e-4), i


def test_train_draft_end_to_end(workdir, tmp_path):
    out = tmp_path / "out"
    before = load_weights(workdir / "parent")
    cfg = TrainConfig(model=str(workdir / "drafter"), data=str(workdir / "data.jsonl"), out=str(out),
                      objective="draft", verifier=str(workdir / "parent"), block_size=3, batch_size=2, max_steps=3,
                      seq_len=64, lr=1e-3, progress=False, eval_every=3, eval_data=str(workdir / "data.jsonl"))
    train(cfg)
    ck = out / (out / "latest").read_text().strip()
    dllm = json.loads((ck / "config.json").read_text())["dllm"]
    assert dllm["verifier"] == str((workdir / "parent").resolve()) and dllm["block_size"] == 3
    rows = list(__import__("csv").DictReader(open(out / "metrics.csv")))
    assert len(rows) == 3 and rows[-1]["accepted"] != "" and rows[-1]["eval_accepted"] != ""
    assert 0.0 <= float(rows[-1]["eval_accepted"]) <= 2.0
    routed, parent = LLM(str(ck)), LLM(str(workdir / "parent"))
    for prompt in ("Two plus", "The quick brown"):
        ref = parent.generate(prompt, SamplingParams(max_tokens=8, temperature=0, block_size=1, ignore_eos=True))
        got = routed.generate(prompt, SamplingParams(max_tokens=8, speculative=True, ignore_eos=True))
        assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert all(torch.equal(before[k], v) for k, v in load_weights(workdir / "parent").items())  # frozen
    trained, init = load_weights(ck), load_weights(workdir / "drafter")
    assert any(not torch.equal(trained[k], init[k]) for k in init)  # the drafter moved


def load_weights(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_draft_option_errors(workdir, tmp_path):
    base = dict(model=str(workdir / "drafter"), data=str(workdir / "data.jsonl"), out=str(tmp_path / "o"),
                progress=False, max_steps=1)
    with pytest.raises(TrainError, match="--verifier"):
        TrainConfig(objective="draft", **base).validate()
    with pytest.raises(TrainError, match="only used by --objective draft"):
        TrainConfig(objective="block", verifier="x", **base).validate()
    with pytest.raises(TrainError, match="do not apply"):
        TrainConfig(objective="draft", verifier="x", teacher_kl=1.0, **base).validate()
    with pytest.raises(TrainError, match="--verifier"):
        train(TrainConfig(objective="draft", verifier=str(tmp_path / "nope"), **base))
    with pytest.raises(TrainError, match="at least 2|>= 2 masks"):
        train(TrainConfig(objective="draft", verifier=str(workdir / "parent"), block_size=1,
                          **{**base, "out": str(tmp_path / "o2")}))


@pytest.mark.parametrize("quantization,verifier_quantization", [("none", None), ("nf4", None), ("nf4", "nf4")])
def test_export_carries_the_verifier(workdir, tmp_path, quantization, verifier_quantization):
    """An export is self-contained: the verifier is exported (quantized alike) into OUT/verifier and named
    relatively; the result still decodes speculatively to the verifier's greedy output."""
    from unmask.training.export import export

    src = tmp_path / "src"
    lm = tiny.loaded(seed=1, initializer_range=0.5)
    dllm = lm.dllm
    dllm.verifier = str(workdir / "parent")
    write_checkpoint(src, lm.model, lm.tokenizer, dllm)
    res = export(src, tmp_path / "out", quantization, verifier_quantization=verifier_quantization)
    assert res["verifier"] == str(workdir / "parent")
    assert res["verifier_quantization"] == (verifier_quantization or "none")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dllm"]["verifier"] == "verifier"
    vcfg = json.loads((tmp_path / "out" / "verifier" / "config.json").read_text())
    assert ("quantization_config" in vcfg) == (verifier_quantization == "nf4")
    routed, parent = LLM(str(tmp_path / "out")), LLM(str(tmp_path / "out" / "verifier"))
    assert routed.model.router is not None
    ref = parent.generate("Two plus", SamplingParams(max_tokens=8, temperature=0, block_size=1, ignore_eos=True))
    got = routed.generate("Two plus", SamplingParams(max_tokens=8, speculative=True, ignore_eos=True))
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    export(src, tmp_path / "plain", "none", keep_verifier=False)
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["dllm"]["verifier"] is None
    assert not (tmp_path / "plain" / "verifier").exists()


def test_draft_with_gradient_checkpointing_is_refused(workdir, tmp_path):
    with pytest.raises(TrainError, match="gradient-checkpointing"):
        TrainConfig(model="m", data="d", out="o", objective="draft", verifier="v",
                    gradient_checkpointing=True).validate()


def test_resume_of_a_run_saved_before_the_draft_objective(workdir, tmp_path):
    """State files written before `draft_groups`/`verifier` existed still resume (block objective)."""
    out = tmp_path / "out"
    lm = tiny.loaded()
    write_checkpoint(tmp_path / "src", lm.model, lm.tokenizer, lm.dllm)
    base = dict(model=str(tmp_path / "src"), data=str(workdir / "data.jsonl"), out=str(out), batch_size=2,
                seq_len=64, lr=1e-3, progress=False, max_steps=2)
    train(TrainConfig(halt_after=1, save_every=1, **base))
    ck = out / (out / "latest").read_text().strip()
    state = torch.load(ck / "training_state.pt", weights_only=False)
    for key in ("draft_groups", "verifier"):
        state["config"].pop(key)
    torch.save(state, ck / "training_state.pt")
    train(TrainConfig(resume=True, **base))
    assert (out / "latest").read_text().strip() == "checkpoint-2"


def test_draft_block_sizes_cycle_one_per_step(workdir, tmp_path, monkeypatch):
    """--draft-block-sizes 2,3: step s drafts groups of sizes[s % 2] (a mixture trains block-2 diffusion and
    block-3 drafting into one drafter)."""
    from unmask.training import losses
    from unmask.training.objectives import draft as draft_mod

    seen = []
    real = losses.build_draft_layout

    def spy(batch, dllm, block_size, generator, max_groups=32):
        seen.append(block_size)
        return real(batch, dllm, block_size, generator, max_groups)

    monkeypatch.setattr(draft_mod, "build_draft_layout", spy)
    train(TrainConfig(model=str(workdir / "drafter"), data=str(workdir / "data.jsonl"), out=str(tmp_path / "o"),
                      objective="draft", verifier=str(workdir / "parent"), block_size=3, draft_block_sizes=[2, 3],
                      batch_size=2, max_steps=4, seq_len=64, lr=1e-3, progress=False))
    assert seen == [2, 3, 2, 3]
    base = dict(model=str(workdir / "drafter"), data=str(workdir / "data.jsonl"), out=str(tmp_path / "e"),
                progress=False, max_steps=1)
    with pytest.raises(TrainError, match="--draft-block-sizes: each must be in 2"):
        TrainConfig(objective="draft", verifier="x", draft_block_sizes=[1, 4], **base).validate()
    with pytest.raises(TrainError, match="--draft-block-sizes: each must be in 2..--seq-len"):
        TrainConfig(objective="draft", verifier="x", draft_block_sizes=[2, 100000], **base).validate()
    with pytest.raises(TrainError, match="--draft-block-sizes: only used by --objective draft"):
        TrainConfig(objective="block", draft_block_sizes=[2], **base).validate()



def test_draft_block_sizes_alone_on_a_block_1_checkpoint(workdir, tmp_path, capsys):
    """A block-1 checkpoint (e.g. a conversion at block 1) trains as a drafter with --draft-block-sizes alone: its
    checkpoints draft at the largest size. Without either option, or with an explicit --block-size 1, the run is a
    one-line error naming both options - and a refused run leaves no --out directory."""
    from unmask.cli.main import main

    lm = tiny.loaded(block_size=1, seed=1, initializer_range=0.5)
    write_checkpoint(tmp_path / "b1", lm.model, lm.tokenizer, lm.dllm)
    refused = tmp_path / "refused"
    base = ["train", "--model", str(tmp_path / "b1"), "--data", str(workdir / "data.jsonl"), "--out", str(refused),
            "--objective", "draft", "--verifier", str(workdir / "parent"), "--no-progress", "--max-steps", "2",
            "--batch-size", "2", "--seq-len", "64", "--lr", "1e-3"]
    for extra in ([], ["--block-size", "1", "--draft-block-sizes", "2,3"]):
        assert main(base + extra) == 2, extra
        (err,) = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]  # (loading bars aside)
        assert err.startswith("unmask train: error: --block-size") and "--draft-block-sizes" in err, (extra, err)
        assert not refused.exists(), extra
    out = tmp_path / "out"
    assert main([str(out) if a == str(refused) else a for a in base] + ["--draft-block-sizes", "2,3"]) == 0
    ck = out / (out / "latest").read_text().strip()
    assert json.loads((ck / "config.json").read_text())["dllm"]["block_size"] == 3
