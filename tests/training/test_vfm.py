"""The VFM trial (``--objective vfm``, unmask.training.experimental.vfm; docs/design.md#the-seeds-methods): the KL term on a
hand-computed case, the beta schedule, z = 0 is exactly plain mask-embedding decoding, a few steps on a fixed batch
lower the loss and change only the noise adapter, an interrupted run resumes to the uninterrupted run's adapter
(the frozen mask-row adapter re-read from --init-adapter), and one-/K-step decoding gives the right shapes and
forward counts."""
from __future__ import annotations

import math

import pytest
import torch

import tiny
from unmask.training.experimental import vfm
from unmask.training.scopes import prepare_model
from unmask.training.trainer import TrainConfig, TrainError, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vfm")
    rows = [{"prompt": f"count {i}", "completion": " ".join(str(j) for j in range(i, i + 6))} for i in range(16)]
    tiny.training_dir(tmp, rows, name="parent", data="d.jsonl", initializer_range=0.5)
    # a trained mask-row adapter to start from (as the trial starts from the shipped default)
    train(TrainConfig(model=str(tmp / "parent"), data=str(tmp / "d.jsonl"), out=str(tmp / "block"),
                      objective="block", trainable="mask_lora", lora_r=4, lora_alpha=8, max_steps=3, batch_size=4,
                      lr=1e-2, progress=False, seq_len=64))
    return tmp


def _cfg(setup, out, **kw):
    base = dict(model=str(setup / "parent"), data=str(setup / "d.jsonl"), out=str(out), objective="vfm",
                trainable="mask_lora", lora_r=4, lora_alpha=8, max_steps=6, batch_size=4, lr=1e-2, progress=False,
                seq_len=64, vfm_gen_len=8, vfm_width=16, init_adapter=str(setup / "block" / "checkpoint-3"))
    base.update(kw)
    return TrainConfig(**base)


def _module(setup, gen_len=8):
    tm = prepare_model(setup / "parent", "mask_lora", 4, 8)
    vfm.attach(tm, gen_len, 16)
    return tm, vfm.VfmForward(tm)


def test_kl_on_a_hand_computed_case():
    mu = torch.tensor([[1.0, 0.0]])
    logvar = torch.tensor([[0.0, math.log(2.0)]])
    # 0.5 * [(1 + 1 - 1 - 0) + (2 + 0 - 1 - ln 2)] = 1 - ln(2) / 2
    assert vfm.kl_standard_normal(mu, logvar).item() == pytest.approx(1 - math.log(2) / 2, abs=1e-6)
    assert vfm.kl_standard_normal(torch.zeros(3, 5), torch.zeros(3, 5)).abs().max() == 0


def test_beta_schedule():
    assert [vfm.beta_at(p, 1e-3, 0.5) for p in (0.0, 0.25, 0.5, 0.9, 1.0)] == pytest.approx(
        [0.0, 5e-4, 1e-3, 1e-3, 1e-3])
    assert vfm.beta_at(0.0, 2.0, 0.0) == 2.0  # no warm-up
    assert vfm.beta_at(-1.0, 1.0, 0.5) == 0.0 and vfm.beta_at(3.0, 1.0, 0.5) == 1.0  # clamped


def test_zero_noise_is_plain_mask_embedding_decoding(setup):
    tm, mod = _module(setup)
    d = tm.dllm
    rows = vfm.build_rows([[5, 6, 7], [8, 9]], [[10, 11, 12], [13]], 8, d.mask_token_id, d.eos_token_ids[0],
                          d.pad_token_id, torch.Generator().manual_seed(0), full=1.0)
    assert rows.masked.all() and rows.labels[1].tolist() == [13] + [d.eos_token_ids[0]] * 7
    with torch.no_grad():
        got, mu, logvar = mod(rows, mode="none")
        dec = tm.base.get_decoder()
        L = rows.input_ids.shape[1]
        variant = rows.valid & (torch.arange(L)[None] >= rows.gen_start[:, None])
        with tm.adapter_state.select(variant):
            h = dec(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=rows.attention_mask,
                    use_cache=False).last_hidden_state
        src = rows.gen_start[:, None] + torch.arange(8)[None] - 1
        ref = tm.base.get_output_embeddings()(h.gather(1, src[..., None].expand(2, 8, h.shape[-1]))).float()
    assert mu.shape == logvar.shape == (2, 8, tm.base.config.hidden_size)
    torch.testing.assert_close(got, ref)
    # the first position's logits are the prompt's last token's (the parent's carry): the noise cannot move them
    with torch.no_grad():
        noisy, _, _ = mod(rows, mode="sample", eps=torch.randn(2, 8, mu.shape[-1]) * 50)
    torch.testing.assert_close(noisy[:, 0], got[:, 0])
    assert not torch.allclose(noisy[:, 1:], got[:, 1:])


def test_steps_on_a_fixed_batch_lower_the_loss_and_train_only_the_noise_adapter(setup):
    tm, mod = _module(setup)
    d = tm.dllm
    before = {n: p.detach().clone() for n, p in tm.base.named_parameters()}
    params = [p for p in tm.base.parameters() if p.requires_grad]
    assert params and all(n.startswith("vfm_noise.") for n, p in tm.base.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=3e-2)
    rows = vfm.build_rows([[5, 6, 7], [8, 9, 10, 11]], [[40, 41, 42, 43], [50, 51, 52]], 8, d.mask_token_id,
                          d.eos_token_ids[0], d.pad_token_id, torch.Generator().manual_seed(1), full=1.0)
    losses = []
    for step in range(25):
        parts = vfm.vfm_loss(mod, rows, torch.Generator().manual_seed(step), beta=1e-4)
        opt.zero_grad()
        parts.loss.backward()
        opt.step()
        losses.append(float(parts.loss.detach()))
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    for n, p in tm.base.named_parameters():
        if not n.startswith("vfm_noise."):
            assert torch.equal(p, before[n]), n


def test_checkpoint_and_resume_round_trip(setup, tmp_path):
    full = tmp_path / "full"
    train(_cfg(setup, full))
    cut = tmp_path / "cut"
    train(_cfg(setup, cut, halt_after=3, save_every=3))
    train(_cfg(setup, cut, resume=True))
    a, b = full / "checkpoint-6", cut / "checkpoint-6"
    names = sorted(p.name for p in a.iterdir())
    assert names == ["mask_adapter.json", "mask_adapter.safetensors", "training_state.pt", vfm.CONFIG_FILE,
                     vfm.ADAPTER_FILE]
    ra, rb = vfm.load_adapter(a), vfm.load_adapter(b)
    for k, v in ra.state_dict().items():
        torch.testing.assert_close(rb.state_dict()[k], v, rtol=0, atol=0, msg=k)
    assert float(ra.out.weight.detach().abs().max()) > 0  # it trained (W_out starts at zero)
    # the frozen mask-row adapter is the --init-adapter's, unchanged
    from unmask.engine.adapter_files import read_adapter

    w0, _ = read_adapter(setup / "block" / "checkpoint-3")
    w6, _ = read_adapter(b)
    for key, (a0, b0) in w0.layers.items():
        assert torch.equal(w6.layers[key][0], a0) and torch.equal(w6.layers[key][1], b0)
    rows = [r.split(",") for r in (full / "metrics.csv").read_text().splitlines()[1:]]
    assert len(rows) == 6 and all(float(r[4]) > 0 for r in rows)  # the kl column holds the VFM KL


def test_options_are_checked(setup, tmp_path):
    with pytest.raises(TrainError, match="mask_lora"):
        train(_cfg(setup, tmp_path / "o1", trainable="full"))
    with pytest.raises(TrainError, match="--vfm-beta"):
        train(_cfg(setup, tmp_path / "o2", vfm_beta=-1.0))
    with pytest.raises(TrainError, match="--vfm-full"):
        train(_cfg(setup, tmp_path / "o3", vfm_full=1.5))
    with pytest.raises(ValueError, match="vfm_adapter.json is missing"):
        vfm.load_adapter(tmp_path)


@pytest.mark.parametrize("mode", ["sample", "mean", "none"])
def test_one_and_k_step_decoding_shapes(setup, mode):
    tm, mod = _module(setup)
    d = tm.dllm
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for steps in (1, 4):
        out = vfm.decode(mod, prompts, 8, steps, mode, d.mask_token_id, d.pad_token_id, set())
        assert [len(o["ids"]) for o in out] == [8, 8, 8]  # no EOS ids: every position is returned
        assert [o["nfe"] for o in out] == [steps] * 3
        assert all(d.mask_token_id not in o["ids"] for o in out)
    # with the EOS ids, an answer ends at its first EOS and never takes more forwards than steps
    out = vfm.decode(mod, prompts, 8, 4, mode, d.mask_token_id, d.pad_token_id, set(d.eos_token_ids))
    for o in out:
        assert 1 <= o["nfe"] <= 4 and 1 <= len(o["ids"]) <= 8
        assert all(t not in d.eos_token_ids for t in o["ids"][:-1])
    with pytest.raises(ValueError, match="steps"):
        vfm.decode(mod, prompts, 8, 9, mode, d.mask_token_id, d.pad_token_id, set())
