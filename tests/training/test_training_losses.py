"""Masked-diffusion losses: hand-computed values, prompt never a label, and training mask == decoding mask."""
from __future__ import annotations

import math

import pytest
import torch

import tiny
from unmask.engine.attention import build_attention_mask
from unmask.engine.denoiser import Denoiser
from unmask.engine.engine import plan_request
from unmask.engine.params import SamplingParams
from unmask.engine.sequence import Sequence
from unmask.training.data import Example, collate
from unmask.training.losses import (Layout, Noise, NoisyBlock, answer_blocks, build_layout, certainty_term,
                                    diffusion_loss, draw_noise, kl_to_teacher)

LN = math.log


def _layout(labels, inv_t, norm):
    n = len(labels)
    z = torch.zeros(n, dtype=torch.long)
    return Layout(input_ids=z[None], position_ids=z[None], attention_mask=torch.ones(1, 1, n, n, dtype=torch.bool),
                  valid=torch.ones(1, n, dtype=torch.bool), src_row=z, src_col=z,
                  labels=torch.tensor(labels), label_row=z, label_pos=torch.arange(n),
                  inv_t=torch.tensor(inv_t, dtype=torch.float32), norm=float(norm))


def test_mdlm_loss_hand_computed():
    # vocab 2; logits [0, ln 3] -> p = (1/4, 3/4). Two masked tokens: label 1 (CE ln 4/3) at t = 0.5 and
    # label 0 (CE ln 4) at t = 0.25; the sequence has 4 answer tokens: L = (2 ln(4/3) + 4 ln 4) / 4.
    logits = torch.tensor([[0.0, LN(3)], [0.0, LN(3)]])
    parts = diffusion_loss(logits, _layout([1, 0], [2.0, 4.0], 4))
    expect = (2 * LN(4 / 3) + 4 * LN(4)) / 4
    assert parts.loss.item() == pytest.approx(expect, rel=1e-6)
    assert parts.n_correct == 1 and parts.n_scored == 2


def test_teacher_kl_hand_computed_full_and_topk():
    logits = torch.tensor([[0.0, LN(3)]])  # q = (1/4, 3/4)
    teacher = torch.log(torch.tensor([[0.5, 0.5]]))
    kl = 0.5 * LN(0.5 / 0.25) + 0.5 * LN(0.5 / 0.75)
    assert kl_to_teacher(logits, teacher).item() == pytest.approx(kl, rel=1e-6)
    # stored top-k: ids in any order, log-probs renormalised over the k ids
    topk = kl_to_teacher(logits, torch.log(torch.tensor([[0.3, 0.3]])), torch.tensor([[1, 0]]))
    assert topk.item() == pytest.approx(kl, rel=1e-6)
    lay = _layout([1], [2.0], 2)  # t = 0.5, two answer tokens
    ce = LN(4 / 3)
    both = diffusion_loss(logits, lay, teacher_kl=0.5, teacher_logprobs=teacher)
    assert both.loss.item() == pytest.approx((2 * ce + 0.5 * 2 * kl) / 2, rel=1e-6)
    only = diffusion_loss(logits, lay, teacher_kl=1.0, ce=False, teacher_logprobs=teacher)
    assert only.loss.item() == pytest.approx(2 * kl / 2, rel=1e-6)
    with pytest.raises(ValueError, match="no-ce"):
        diffusion_loss(logits, lay, ce=False)


def _entropy(ps):
    return -sum(p * LN(p) for p in ps)


def test_certainty_term_hand_computed_only_correct_rows():
    # row 0: argmax 1 = label (correct); row 1: same logits, label 0 (wrong, excluded); row 2: argmax 0 = label.
    logits = torch.tensor([[0.0, LN(3)], [0.0, LN(3)], [LN(4), 0.0]])
    labels = torch.tensor([1, 0, 0])
    # T = 1: p = (1/4, 3/4) and (4/5, 1/5); T = 0.5 squares the odds: (1/10, 9/10) and (16/17, 1/17)
    assert certainty_term(logits, labels, 1.0).item() == pytest.approx(
        (_entropy([0.25, 0.75]) + _entropy([0.8, 0.2])) / 2, rel=1e-6)
    assert certainty_term(logits, labels, 0.5).item() == pytest.approx(
        (_entropy([0.1, 0.9]) + _entropy([16 / 17, 1 / 17])) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="certainty_temperature"):
        certainty_term(logits, labels, 0.0)


def test_certainty_term_zero_and_connected_when_nothing_is_correct():
    logits = torch.tensor([[0.0, LN(3)]], requires_grad=True)
    term = certainty_term(logits, torch.tensor([0]))
    assert term.item() == 0.0
    term.backward()  # still part of the graph (DDP needs every loss connected)
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_certainty_in_diffusion_loss_adds_weighted_entropy_and_sharpens():
    logits = torch.tensor([[0.0, LN(3)], [0.0, LN(3)]])
    lay = _layout([1, 0], [2.0, 4.0], 4)
    base = diffusion_loss(logits, lay)
    withc = diffusion_loss(logits, lay, certainty=2.0, certainty_temperature=1.0)
    h = _entropy([0.25, 0.75])  # only row 0 is correct
    assert withc.certainty == pytest.approx(h, rel=1e-6) and base.certainty == 0.0
    assert withc.loss.item() == pytest.approx(base.loss.item() + 2.0 * h, rel=1e-6)
    assert withc.ce == pytest.approx(base.ce)
    with pytest.raises(ValueError, match="certainty"):
        diffusion_loss(logits, lay, certainty=-1.0)
    # a gradient step on the certainty term alone raises the confidence of the correct prediction
    x = torch.tensor([[0.0, LN(3)]], requires_grad=True)
    certainty_term(x, torch.tensor([1]), 0.5).backward()
    with torch.no_grad():
        y = x - 0.5 * x.grad
    assert torch.softmax(y, -1)[0, 1] > torch.softmax(x.detach(), -1)[0, 1]


def _example(prompt_len, answer_len, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (prompt_len + answer_len,), generator=g).tolist()
    ans = [False] * prompt_len + [True] * answer_len
    return Example(ids, ans, [(prompt_len, prompt_len + answer_len)])


def test_block_layout_hand_computed_indices():
    # prompt 3 tokens, answer at 3..6, block 2 -> blocks [3,5) and [5,7); clean copy at columns 0..6, noisy
    # block 0 at 7..8, block 1 at 9..10. Logit shift: position 3 (block start) reads the clean output 2,
    # position 4 reads noisy column 7 (position 3's copy), position 6 reads column 9 (position 5's copy).
    lm = tiny.loaded(block_size=2)
    batch = collate([_example(3, 4)], pad_id=0)
    noise = Noise(blocks=[NoisyBlock(0, 3, 5, 3, 0.5, [3, 4]), NoisyBlock(0, 5, 7, 3, 0.25, [6])])
    lay = build_layout(batch, lm.dllm, noise)
    assert lay.src_col.tolist() == [2, 7, 9]
    assert lay.label_pos.tolist() == [3, 4, 6]
    assert lay.labels.tolist() == batch.input_ids[0, [3, 4, 6]].tolist()
    assert lay.inv_t.tolist() == [2.0, 2.0, 4.0]
    assert lay.norm == 4.0
    m = lm.dllm.mask_token_id
    assert lay.input_ids[0, 7:11].tolist() == [m, m, int(batch.input_ids[0, 5]), m]
    assert lay.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    # without logit shift the noisy copies' own outputs are read
    lm.dllm.logit_shift = False
    assert build_layout(batch, lm.dllm, noise).src_col.tolist() == [7, 8, 10]
    # the loss is sum CE / t / N_answer
    logits = torch.zeros(3, lm.vocab_size)
    parts = diffusion_loss(logits, lay)
    assert parts.loss.item() == pytest.approx((2 + 2 + 4) * LN(lm.vocab_size) / 4, rel=1e-5)


def test_blocks_that_mask_nothing_are_not_forwarded_and_the_loss_is_unchanged():
    """A noisy copy with no masked position is skipped: shorter rows, same scored logits and loss (no position
    attends to a noisy copy other than the copy itself)."""
    torch.manual_seed(0)
    lm = tiny.loaded(block_size=4)
    batch = collate([_example(5, 12, vocab=300, seed=1)], pad_id=lm.dllm.pad_token_id)
    noise = Noise(blocks=[NoisyBlock(0, 5, 9, 5, 0.5, [6, 8]), NoisyBlock(0, 9, 13, 5, 0.01, []),
                          NoisyBlock(0, 13, 17, 5, 0.9, [13, 14, 16])])
    full = build_layout(batch, lm.dllm, noise, skip_unmasked=False)
    lean = build_layout(batch, lm.dllm, noise)
    assert lean.input_ids.shape[1] == full.input_ids.shape[1] - 4 and len(lean.block_offsets) == 2
    assert lean.labels.tolist() == full.labels.tolist() and lean.label_pos.tolist() == full.label_pos.tolist()

    def scored_logits(lay):
        with torch.no_grad():
            h = lm.model.model(input_ids=lay.input_ids, position_ids=lay.position_ids,
                               attention_mask=lay.attention_mask).last_hidden_state
            return lm.model.lm_head(h[lay.src_row, lay.src_col]).float()
    a, b = scored_logits(full), scored_logits(lean)
    assert torch.allclose(a, b, atol=1e-5)
    assert diffusion_loss(a, full).loss.item() == pytest.approx(diffusion_loss(b, lean).loss.item(), rel=1e-6)


def test_prompt_tokens_never_labels_and_noise_stats():
    lm = tiny.loaded(block_size=3)
    exs = [_example(5, 7, seed=1), _example(2, 9, seed=2)]
    exs.append(Example(list(range(10, 30)), [False] * 4 + [True] * 5 + [False] * 6 + [True] * 5, [(4, 9), (15, 20)]))
    batch = collate(exs, pad_id=0)
    g = torch.Generator().manual_seed(0)
    for objective, attention in (("block", "prefix_causal"), ("mdlm", "prefix_causal"), ("mdlm", "bidirectional"),
                                 ("block", "block_causal")):
        lm.dllm.attention = attention
        for comp in (False, True):
            if attention == "bidirectional" and comp:
                continue
            noise = draw_noise(batch, lm.dllm, objective, g, complementary=comp)
            lay = build_layout(batch, lm.dllm, noise)
            assert bool(batch.answer[lay.label_row, lay.label_pos].all())
            assert lay.n_tokens >= batch.n_tokens
            if comp:  # every answer position is masked in exactly one of the two copies
                cover = torch.zeros_like(batch.answer, dtype=torch.long)
                for b in noise.blocks:
                    for p in b.masked:
                        cover[b.row, p] += 1
                assert torch.equal(cover, batch.answer.long())
    lm.dllm.attention = "bidirectional"
    with pytest.raises(ValueError, match="bidirectional"):
        draw_noise(batch, lm.dllm, "block", g)
    with pytest.raises(ValueError, match="complementary"):
        draw_noise(batch, lm.dllm, "mdlm", g, complementary=True)


def test_answer_blocks_alignment():
    assert answer_blocks([(5, 12)], 4) == [(5, 9, 5), (9, 12, 5)]
    assert answer_blocks([(5, 12)], 4, "absolute") == [(4, 8, 5), (8, 12, 5)]
    assert answer_blocks([(5, 12), (14, 16)], None) == [(5, 12, 5), (14, 16, 14)]


@pytest.mark.parametrize("attention", ["prefix_causal", "block_causal"])
def test_training_mask_and_logits_equal_engine(attention):
    """For each noisy block: its rows of the training mask equal the denoiser's mask for that active block, and
    the logits at its masked positions equal the engine's step logits for the same canvas."""
    torch.manual_seed(0)
    bs = 4
    lm = tiny.loaded(attention=attention, block_size=bs)
    P, A = 6, 12
    ex = _example(P, A, vocab=300, seed=3)
    batch = collate([ex], pad_id=lm.dllm.pad_token_id)
    g = torch.Generator().manual_seed(5)
    noise = draw_noise(batch, lm.dllm, "block", g)
    noise.blocks[0].masked = list(range(P, P + 4))  # all masked
    noise.blocks[1].masked = [P + 5, P + 7]  # first position visible
    noise.blocks[2].masked = [P + 8]  # only the first (read from the committed token's output)
    lay = build_layout(batch, lm.dllm, noise)
    with torch.no_grad():
        hidden = lm.model.model(input_ids=lay.input_ids, position_ids=lay.position_ids,
                                attention_mask=lay.attention_mask).last_hidden_state
        train_logits = lm.model.lm_head(hidden[lay.src_row, lay.src_col]).float()
    den = Denoiser(lm)
    ids = batch.input_ids[0]
    for bi, (blk, (row, a, e, off)) in enumerate(zip(noise.blocks, lay.block_offsets)):
        assert (blk.start, blk.end) == (a, e)
        plan = plan_request(lm, SamplingParams(max_tokens=A, temperature=0.0, cache="none", seed=0))
        seq = Sequence("t", ids[:P].tolist(), plan, lm.dllm, lm.tokenizer, lm.max_context)
        seq.canvas[P:a] = ids[P:a]
        seq.canvas[a:e] = lay.input_ids[0, off:off + e - a]
        seq.goto_block(bi)
        (inp,) = seq.lane_inputs()
        assert inp.chunk.tolist() == list(range(e))
        valid = torch.ones(1, e, dtype=torch.bool)
        eng = build_attention_mask(inp.chunk[None], inp.grp[None], inp.start[None], valid, inp.chunk[None],
                                   inp.grp[None], inp.committed[None], valid)[0, 0]
        tr = lay.attention_mask[0, 0]
        rows = torch.arange(off, off + e - a)
        assert torch.equal(tr[rows][:, :a], eng[a:e, :a])           # noisy block -> committed clean context
        assert torch.equal(tr[rows][:, off:off + e - a], eng[a:e, a:e])  # inside the block
        others = torch.ones(tr.shape[1], dtype=torch.bool)
        others[:a] = False
        others[off:off + e - a] = False
        assert not bool(tr[rows][:, others].any())                   # nothing else (later clean, other blocks)
        assert torch.equal(tr[:a, :a], eng[:a, :a])                  # committed rows: as decoding commits them
        # logits at the masked positions == the engine's step logits for this canvas
        masked = seq.masked_positions().tolist()
        assert masked == blk.masked
        with torch.no_grad():
            logits, spans, _ = den._forward([(seq, 0, inp)])
            eng_logits = logits[spans[0][0]:spans[0][1]]
        sel = [i for i, p in enumerate(lay.label_pos.tolist()) if p in masked and a <= p < e]
        assert len(sel) == len(masked)
        torch.testing.assert_close(train_logits[sel], eng_logits, atol=2e-5, rtol=1e-5)
