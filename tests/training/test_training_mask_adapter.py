"""Training the mask-row adapter (``--trainable mask_lora``, unmask.training.mask_adapter): a few steps lower the
loss and change only the adapter's tensors and the mask embedding; the adapter runs on the noisy copies of the
block layout only; the saved adapter-only checkpoint serves with the parent's greedy answers by default."""
from __future__ import annotations


import pytest
import torch

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.adapter_files import read_adapter
from unmask.engine.model import load_model
from unmask.training.mask_adapter import variant_rows_of_block_layout
from unmask.training.trainer import TrainConfig, TrainError, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mask_lora")
    rows = [{"prompt": f"count {i}", "completion": " ".join(str(j) for j in range(i, i + 12))} for i in range(16)]
    tiny.training_dir(tmp, rows, name="parent", data="d.jsonl", initializer_range=0.5)
    return tmp


def _cfg(setup, out, objective, **kw):
    return TrainConfig(model=str(setup / "parent"), data=str(setup / "d.jsonl"), out=str(out), objective=objective,
                       trainable="mask_lora", lora_r=4, lora_alpha=8, max_steps=30, batch_size=4, lr=1e-2,
                       progress=False, seq_len=64, **kw)


@pytest.mark.parametrize("objective", ["block", "draft"])
def test_training_lowers_the_loss_and_changes_only_the_adapter(setup, tmp_path, objective):
    out = tmp_path / "out"
    train(_cfg(setup, out, objective))
    rows = [r.split(",") for r in (out / "metrics.csv").read_text().splitlines()[1:]]
    first, last = (sum(float(r[2]) for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last < 0.8 * first, (first, last)
    ckpt = out / "checkpoint-30"
    assert sorted(p.name for p in ckpt.iterdir()) == ["mask_adapter.json", "mask_adapter.safetensors",
                                                      "training_state.pt"]
    weights, cfg = read_adapter(ckpt)
    assert cfg["dllm"]["default_sampling"]["speculative"] is True
    assert any(float(b.abs().max()) > 0 for _, b in weights.layers.values())  # B left zero = nothing trained
    parent = load_model(setup / "parent", weights="native")
    mask_row = parent.model.get_input_embeddings().weight[parent.dllm.mask_token_id]
    assert not torch.equal(weights.mask_embedding, mask_row)
    # the parent's weights are untouched: the adapter model's causal path is the parent's
    adapted = LLM(load_model(out))
    ref = LLM(parent).generate("count 3", SamplingParams(max_tokens=10, temperature=0, block_size=1,
                                                         ignore_eos=True))[0].outputs[0].token_ids
    got = adapted.generate("count 3", SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert got.speculative and got.token_ids == ref
    # the recipe's export: adapter-only, fp16 tensors, no training state, the parent named absolutely
    from unmask.training.mask_adapter import export_adapter

    exp = export_adapter(ckpt, tmp_path / "export", setup / "parent")
    assert sorted(p.name for p in exp.iterdir()) == ["mask_adapter.json", "mask_adapter.safetensors"]
    assert (exp / "mask_adapter.safetensors").stat().st_size < (ckpt / "mask_adapter.safetensors").stat().st_size
    again = LLM(load_model(exp)).generate("count 3", SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert again.token_ids == ref


def test_the_adapter_runs_on_the_noisy_copies_only():
    from unmask.training.data import collate  # noqa: F401 (the layout builder below is the trainer's)
    from unmask.training.losses import build_layout, draw_noise

    lm = tiny.loaded()
    from types import SimpleNamespace

    ids = torch.arange(3, 23).unsqueeze(0)
    batch = SimpleNamespace(input_ids=ids, valid=torch.ones_like(ids, dtype=torch.bool),
                            answer=torch.tensor([[False] * 6 + [True] * 14]), spans=[[(6, 20)]], teacher=None)
    noise = draw_noise(batch, lm.dllm, "block", torch.Generator().manual_seed(0), 4, 1e-3, False, fixed_t=0.99)
    lay = build_layout(batch, lm.dllm, noise, 4, skip_unmasked=False)
    rows = variant_rows_of_block_layout(lay.position_ids)[0]
    assert not rows[:20].any() and rows[20:].all() and int(rows.sum()) == lay.input_ids.shape[1] - 20


def test_mask_lora_options_are_checked(setup, tmp_path):
    with pytest.raises(TrainError, match="mask_lora"):
        train(_cfg(setup, tmp_path / "o1", "mdlm"))
    with pytest.raises(TrainError, match="--verifier"):
        train(_cfg(setup, tmp_path / "o2", "draft", verifier=str(setup / "parent")))
