"""Verifier-routed speculative decoding (unmask.engine.routed): causal rows run the verifier's weights, mask rows
the drafter's; the output equals the verifier's block_size=1 greedy decoding; ordinary requests are untouched;
checkpoints name their verifier; the ``draft`` training objective builds the same forward as decoding."""
from __future__ import annotations

import json

import pytest
import torch

from tiny import loaded, loaded_with_verifier
from unmask.engine import LLM, SamplingParams
from unmask.engine.config import CheckpointError, DllmConfig
from unmask.engine.routed import RoutedModule, RowRouter

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two", "Paris"]


@pytest.fixture(scope="module")
def pair():
    routed, verifier = loaded_with_verifier(initializer_range=0.5)
    drafter_alone = loaded(attention="prefix_causal", seed=1, initializer_range=0.5)
    return LLM(routed), LLM(verifier), LLM(drafter_alone)


def _b1(llm, prompt, n):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, block_size=1, speculative=False,
                                               ignore_eos=True))[0].outputs[0]


def test_the_two_models_differ(pair):
    """Guard: the tests below could not tell the verifier from the drafter if both decoded alike."""
    routed, verifier, drafter = pair
    assert any(_b1(verifier, p, 12).token_ids != _b1(drafter, p, 12).token_ids for p in PROMPTS)


@pytest.mark.parametrize("block", [2, 4])
@pytest.mark.parametrize("branches", [None, 0])
@pytest.mark.parametrize("cache", ["auto", "none"])
def test_speculative_output_is_the_verifiers_greedy_output(pair, block, branches, cache):
    routed, verifier, _ = pair
    for prompt in PROMPTS:
        for n in (1, 5, 13):
            ref = _b1(verifier, prompt, n)
            out = routed.generate(prompt, SamplingParams.from_flat(max_tokens=n, block_size=block, speculative=True,
                                                         speculative_branches=branches, cache=cache,
                                                         ignore_eos=True))[0].outputs[0]
            assert out.token_ids == ref.token_ids, (prompt, n)


def test_constrained_greedy_is_the_verifiers_constrained_block_1(pair):
    """A grammar holds on the separate-verifier path (docs/design.md#constrained-decoding): the routed model's
    constrained speculative answer is its verifier's constrained block-1 answer."""
    from test_constraints import assert_speculative_constrained_greedy_is_constrained_block_1

    routed, verifier, _ = pair
    assert_speculative_constrained_greedy_is_constrained_block_1(routed, verifier)


def test_drafts_come_from_the_drafter(pair):
    """Same tokens as the verifier drafting for itself, but other drafts: the mask rows run the drafter's weights."""
    from unmask.engine.engine import plan_request
    from unmask.engine.speculative import SpeculativeSequence

    routed, verifier, _ = pair
    p = SamplingParams(max_tokens=24, block_size=4, speculative=True, ignore_eos=True)
    ids = verifier.model.tokenizer(PROMPTS[1]).input_ids
    drafts = {}
    for name, llm in (("routed", routed), ("self", verifier)):
        seq = SpeculativeSequence("r", ids, plan_request(llm.model, p), llm.model.dllm, llm.model.tokenizer,
                                  llm.model.max_context, llm.model.device, vocab_size=llm.model.vocab_size)
        seen = []
        while not seq.finished:
            llm.denoiser.step([seq])
            seen.append(list(seq.drafts))
        drafts[name] = (seen, seq.canvas.tolist())
    assert drafts["routed"][1] == drafts["self"][1]
    assert drafts["routed"][0] != drafts["self"][0]


def test_ordinary_decoding_runs_the_drafter_only(pair):
    routed, _, drafter = pair
    for prompt in PROMPTS:
        for kw in ({"block_size": 1}, {"block_size": 4, "steps": 8}, {"block_size": 4, "threshold": 0.5}):
            p = SamplingParams(max_tokens=8, temperature=0, speculative=False, ignore_eos=True, **kw)
            assert routed.generate(prompt, p)[0].outputs[0].token_ids == \
                drafter.generate(prompt, p)[0].outputs[0].token_ids, (prompt, kw)


def test_mixed_batch_is_batch_invariant(pair):
    routed, _, _ = pair
    params = [SamplingParams(max_tokens=9, block_size=4, speculative=True, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, block_size=4, steps=9, speculative=False, ignore_eos=True),
              SamplingParams(max_tokens=6, block_size=2, speculative=True, ignore_eos=True)]
    from unmask.engine.llm import make_sequences
    from unmask.engine.scheduler import Scheduler

    alone = [routed.generate(PROMPTS[i], params[i])[0].outputs[0].token_ids for i in range(3)]
    seqs = [make_sequences(routed.model, routed.model.tokenizer(PROMPTS[i]).input_ids, params[i], f"r{i}")[0]
            for i in range(3)]
    sched = Scheduler(routed.denoiser, max_batch_size=8)
    for s in seqs:
        sched.add(s)
    while sched.has_work():
        sched.step()
    assert [list(s.output_ids) for s in seqs] == alone


def test_routed_module_splits_rows_and_checks_shapes():
    d, v = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    router = RowRouter()
    m = RoutedModule(d, v, router)
    x = torch.randn(2, 5, 3)
    assert torch.equal(m(x), d(x))
    rows = torch.tensor([[True, False, True, False, False], [False] * 5])
    router.drafter_rows = rows
    out = m(x)
    assert torch.allclose(out[rows], d(x[rows])) and torch.allclose(out[~rows], v(x[~rows]))
    router.drafter_rows = torch.ones(3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="row mask"):
        m(x)


def test_attach_verifier_rejects_another_architecture():
    from unmask.engine.routed import attach_verifier

    a = loaded(seed=0).model
    b = loaded(seed=0, num_hidden_layers=3).model
    with pytest.raises(ValueError, match="architecture differs"):
        attach_verifier(a, b)
    c = loaded(seed=0, intermediate_size=96).model
    with pytest.raises(ValueError, match="intermediate_size"):
        attach_verifier(loaded(seed=1).model, c)


# ------------------------------------------------------------------ checkpoints
def _save(path, lm, verifier=None):
    from unmask.engine.checkpoint import write_checkpoint

    dllm = DllmConfig.from_dict({**lm.dllm.to_dict(), "verifier": verifier})
    write_checkpoint(path, lm.model, lm.tokenizer, dllm)
    return path


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    v = _save(root / "parent", loaded(seed=0, initializer_range=0.5))
    d = _save(root / "drafter", loaded(seed=1, initializer_range=0.5), verifier="../parent")
    return root, v, d


def test_checkpoint_names_its_verifier(saved_pair):
    root, v, d = saved_pair
    routed, verifier = LLM(str(d)), LLM(str(v))
    assert routed.model.router is not None and verifier.model.router is None
    for prompt in PROMPTS:
        ref = _b1(verifier, prompt, 10)
        out = routed.generate(prompt, SamplingParams(max_tokens=10, block_size=4, speculative=True,
                                                     ignore_eos=True))[0].outputs[0]
        assert out.token_ids == ref.token_ids


def _with_dllm(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dllm"].update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_checkpoint_verifier_errors(saved_pair, tmp_path):
    from unmask.engine.model import load_model

    root, v, d = saved_pair
    with pytest.raises(CheckpointError, match=r"dllm\.verifier.*not a directory"):
        load_model(str(_with_dllm(d, tmp_path / "a", verifier=str(tmp_path / "missing"))))
    chained = _with_dllm(d, tmp_path / "b", verifier=str(d))
    with pytest.raises(CheckpointError, match="verifier itself"):
        load_model(str(chained))
    other = _save(tmp_path / "wide", loaded(seed=0, hidden_size=32, num_attention_heads=4))
    with pytest.raises(CheckpointError, match=r"dllm\.verifier.*hidden_size"):
        load_model(str(_with_dllm(d, tmp_path / "c", verifier=str(other))))
    mask_other = _with_dllm(v, tmp_path / "v2", mask_token_id=0)
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_model(str(_with_dllm(d, tmp_path / "d", verifier=str(mask_other))))


def test_dllm_verifier_validation():
    base = dict(family="a2d", mask_token_id=5, attention="prefix_causal", block_size=4, logit_shift=True,
                eos_token_ids=[0])
    assert DllmConfig.from_dict({**base, "verifier": "parent"}).verifier == "parent"
    for bad in ("", "  ", 3):
        with pytest.raises(CheckpointError, match="verifier"):
            DllmConfig.from_dict({**base, "verifier": bad})
    with pytest.raises(CheckpointError, match="verifier: needs prefix_causal"):
        DllmConfig.from_dict({**base, "attention": "bidirectional", "verifier": "parent"})


def test_serve_log_names_the_weight_format():
    import types

    from unmask.cli.serve import _weights_kind

    def fake(qc, fmt="native"):
        return types.SimpleNamespace(dtype=torch.float32, weight_format=fmt, model=types.SimpleNamespace(
            config=types.SimpleNamespace(quantization_config=qc)))

    assert _weights_kind(fake(None)) == "float32"
    assert _weights_kind(fake({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"})) == "nf4 (compute float32)"
    assert _weights_kind(fake({"load_in_8bit": True})) == "int8 (compute float32)"
    assert _weights_kind(fake({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "fp16")).startswith(
        "nf4 (compute float32), run as fp16-packed linear layers")


def test_attach_verifier_rejects_another_head_split_or_rope():
    """Equal weight shapes, other head split / RoPE base: the parameter-free code would run with the model's
    settings on the verifier's rows, so attaching must fail (naming the setting)."""
    from unmask.engine.routed import attach_verifier

    a = loaded(seed=0).model
    with pytest.raises(ValueError, match="num_attention_heads"):
        attach_verifier(a, loaded(seed=0, num_attention_heads=8, num_key_value_heads=4).model)
    with pytest.raises(ValueError, match="rope"):
        attach_verifier(loaded(seed=1).model, loaded(seed=0, rope_theta=500.0).model)


def test_checkpoint_verifier_with_other_token_ids_is_rejected(saved_pair, tmp_path):
    from unmask.engine.model import load_model

    root, v, d = saved_pair
    other = _with_dllm(v, tmp_path / "v3", suppress_token_ids=[5])
    with pytest.raises(CheckpointError, match="suppress_token_ids"):
        load_model(str(_with_dllm(d, tmp_path / "e", verifier=str(other))))


def test_tied_embeddings_route_at_both_ends():
    """SmolLM2 ties its LM head to the input embedding: each end must still split rows between the weight sets."""
    routed, verifier = loaded_with_verifier(tie_word_embeddings=True, initializer_range=0.5)
    drafter = loaded(seed=1, tie_word_embeddings=True, initializer_range=0.5)
    ids = torch.tensor([verifier.tokenizer("Hello world, one two").input_ids])
    pos = torch.arange(ids.shape[1])[None]
    rows = torch.zeros_like(ids, dtype=torch.bool)
    rows[0, -2:] = True
    with torch.no_grad():
        hv = verifier.model.base_model(input_ids=ids, position_ids=pos).last_hidden_state
        hr = routed.hidden_states(ids, pos, None, variant_rows=~rows)
        assert torch.allclose(hr[~rows], hv[~rows], atol=1e-5)  # causal rows never see later rows
        lr = routed.logits(hr[0], variant_rows=~rows[0])
        assert torch.allclose(lr[:-2], verifier.model.lm_head(hv[0, :-2]).float(), atol=1e-4)
        assert torch.allclose(lr[-2:], drafter.model.lm_head(hr[0, -2:]).float(), atol=1e-4)


# ---------------------------------------------------------------- the row-variant seam (unmask.engine.model.RowVariant)
class _HeadOffset(torch.nn.Module):
    """A second RowVariant, in the shape a per-row LoRA adapter takes: it wraps one module (the LM head) and adds
    its delta (here a constant logit offset) on the variant rows only, with the rows ``select`` stores."""

    def __init__(self, head, offset: float):
        super().__init__()
        self.head, self.offset, self.rows = head, offset, None

    @property
    def weight(self):
        return self.head.weight

    def forward(self, x):
        out = self.head(x)
        if self.rows is None:
            return out
        return out + self.offset * self.rows[..., None].to(out.dtype)

    def select(self, variant_rows):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.rows = variant_rows
            try:
                yield
            finally:
                self.rows = None
        return ctx()


def test_a_second_row_variant_plugs_into_the_same_seam():
    plain = loaded(attention="prefix_causal", seed=1, initializer_range=0.5)
    lm = loaded(attention="prefix_causal", seed=1, initializer_range=0.5)
    adapter = _HeadOffset(lm.model.get_output_embeddings(), 3.0)
    lm.model.set_output_embeddings(adapter)
    assert not lm.has_row_variant
    lm.attach_row_variant(adapter)
    assert lm.has_row_variant and lm.router is adapter
    with pytest.raises(ValueError, match="has one already"):
        lm.attach_row_variant(adapter)
    h = torch.randn(4, plain.model.config.hidden_size)
    rows = torch.tensor([True, False, False, True])
    with torch.no_grad():
        ref = plain.logits(h)
        got = lm.logits(h, variant_rows=rows)
        assert torch.equal(lm.logits(h), ref) and torch.equal(got[~rows], ref[~rows])
        assert torch.allclose(got[rows], ref[rows] + 3.0)
        assert torch.equal(lm.logits(h, drafter_rows=~rows), got)  # the old spelling, the complement
    # ordinary requests run no variant row; speculative ones run their causal rows through it (the offset is the
    # same on every id there, so greedy verification picks the same tokens)
    for params in (SamplingParams(max_tokens=8, temperature=0, block_size=4, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=0, block_size=4, speculative=True, ignore_eos=True)):
        assert [o.outputs[0].token_ids for o in LLM(lm).generate(PROMPTS, params)] == \
               [o.outputs[0].token_ids for o in LLM(plain).generate(PROMPTS, params)]


def test_variant_rows_select_the_verifier_rows():
    routed, verifier = loaded_with_verifier(initializer_range=0.5)
    assert routed.has_row_variant and isinstance(routed.row_variant, RowRouter) and not verifier.has_row_variant
    ids = torch.tensor([verifier.tokenizer("Hello world, one two").input_ids])
    pos = torch.arange(ids.shape[1])[None]
    rows = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        hv = verifier.hidden_states(ids, pos, None)
        assert torch.allclose(routed.hidden_states(ids, pos, None, variant_rows=rows), hv, atol=1e-5)
        assert torch.equal(routed.hidden_states(ids, pos, None, variant_rows=~rows),
                           routed.hidden_states(ids, pos, None))
    assert routed.row_variant.drafter_rows is None  # the selection ends with the forward
