"""The fused decoder forward (unmask.engine.fused_decoder) of packed Llama-architecture models: every forward of
real decoding runs (batched lanes of different cache lengths, one-row and block steps, speculative steps, routed
verifier rows) gives the transformers forward's hidden states of the same packed model; architectures it does not
cover keep the transformers forward; the merged projections are stored once."""
from __future__ import annotations

import pytest
import torch

import tiny
from unmask.engine import LLM, SamplingParams
from unmask.engine.config import DllmConfig
from unmask.engine.fused_decoder import FusedDecoder, ProjectionSlice, fuse_projections, unsupported_reason
from unmask.engine.model import LoadedModel
from unmask.engine.packed_weights import PackedFp16Linear, fbgemm_available, pack_model

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="the fused path runs with fbgemm-packed weights")

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. One two three four", "Paris"]


def _wrap(model, tok) -> LoadedModel:
    mask_id = tok.convert_tokens_to_ids("[MASK]")
    eos = [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")]
    dllm = DllmConfig(family="a2d", mask_token_id=mask_id, attention="prefix_causal", block_size=4, logit_shift=True,
                      eos_token_ids=eos, pad_token_id=eos[0])
    return LoadedModel(model=model, tokenizer=tok, dllm=dllm, path="<memory>", device=torch.device("cpu"),
                       dtype=torch.float32, max_context=512)


def _qwen(kind: str, **extra) -> LoadedModel:
    """A tiny Qwen2 (q/k/v biases made large) or Qwen3 (per-head q/k RMSNorms made non-trivial) model."""
    import transformers

    tok = tiny.make_tokenizer(mask_token="[MASK]")
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**{"use_sliding_window": False, **common, **extra})
        model_cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**{"head_dim": 16, "attention_bias": False, **common, **extra})
        model_cls = transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "sdpa"
    model = model_cls(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return _wrap(model, tok)


def _model(kind: str) -> LoadedModel:
    if kind == "llama-gqa":
        return tiny.loaded(initializer_range=0.3)
    if kind == "llama-mha":
        return tiny.loaded(initializer_range=0.3, num_key_value_heads=4)
    if kind == "routed":
        routed, _ = tiny.loaded_with_verifier(initializer_range=0.3)
        return routed
    return _qwen(kind)


class _PathRecorder:
    """Runs every decoder forward of a generation through both paths; keeps the shapes and relative differences
    (the fused path's output is the one decoding continues with)."""

    def __init__(self, lm: LoadedModel):
        self.lm, self.fused = lm, lm.decoder_forward
        self.orig = lm.hidden_states
        self.records: list[dict] = []
        lm.hidden_states = self

    def __call__(self, input_ids, position_ids, attention_mask, cache=None, variant_rows=None, **kw):
        self.lm.decoder_forward = None
        try:
            ref = self.orig(input_ids, position_ids, attention_mask, cache=cache, variant_rows=variant_rows, **kw)
        finally:
            self.lm.decoder_forward = self.fused
        out = self.orig(input_ids, position_ids, attention_mask, cache=cache, variant_rows=variant_rows, **kw)
        self.records.append({"shape": tuple(input_ids.shape), "cached": cache.cached_len if cache is not None else 0,
                             "uniform": cache is None or len({lane.length for lane in cache.lanes}) == 1,
                             "routed": variant_rows is not None and bool(variant_rows.any()) and not bool(variant_rows.all()),
                             "rel": float((out - ref).norm() / ref.norm()), "abs": float((out - ref).abs().max())})
        return out


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha", "qwen2", "qwen3", "routed"])
def test_fused_forward_equals_transformers_forward_in_real_decoding(kind):
    lm = _model(kind)
    pack_model(lm, "fp16")
    assert lm.decoder_path == "fused" and isinstance(lm.decoder_forward, FusedDecoder)
    rec = _PathRecorder(lm)
    llm = LLM(lm)
    with torch.no_grad():
        # a batch of lanes of different lengths, one-row steps, block steps with the cache, speculative steps
        llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, block_size=1, ignore_eos=True))
        llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.8, seed=3, block_size=4, ignore_eos=True))
        llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, block_size=4, speculative=True,
                                             ignore_eos=True))
        llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, block_size=8, cache="none",
                                                ignore_eos=True))
    recs = rec.records
    assert any(r["shape"][1] == 1 and r["cached"] > 0 for r in recs)  # one-row steps against a cache
    assert any(r["shape"][0] > 1 and not r["uniform"] for r in recs)  # lanes of different cache lengths
    assert any(r["shape"][1] > 1 and r["cached"] > 0 for r in recs)  # block steps against a cache
    assert any(r["cached"] == 0 and r["shape"][1] > 8 for r in recs)  # uncached forwards of whole canvases
    if kind == "routed":
        assert any(r["routed"] for r in recs)  # forwards mixing drafter and verifier rows
    worst = max(recs, key=lambda r: r["rel"])
    assert worst["rel"] < 2e-6 and worst["abs"] < 1e-4, worst


def test_fused_generation_matches_the_transformers_path_token_for_token():
    """Decoding end to end: the same tokens through either path (greedy; sharp tiny model)."""
    lm = tiny.loaded(initializer_range=0.5)
    pack_model(lm, "fp16")
    llm = LLM(lm)
    params = SamplingParams(max_tokens=12, temperature=0, block_size=4, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    lm.decoder_forward = None
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert fused == ref


def test_projections_are_merged_and_stored_once():
    lm = tiny.loaded()
    pack_model(lm, "fp16")
    attn, mlp = lm.model.model.layers[0].self_attn, lm.model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, PackedFp16Linear) and isinstance(mlp.gate_up_proj, PackedFp16Linear)
    assert attn.qkv_proj.out_features == 64 + 2 * 32 and mlp.gate_up_proj.out_features == 2 * 128
    assert [type(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")] == [ProjectionSlice] * 3
    # the slices do not register the fused layer again: 2 layers x (qkv, o, gate_up, down) + the LM head
    assert sum(isinstance(m, PackedFp16Linear) for m in lm.model.modules()) == 2 * 4 + 1
    # the old names still compute their part of the fused projection
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        assert torch.equal(attn.k_proj(x), attn.qkv_proj(x)[..., 64:96])
        assert torch.equal(mlp.up_proj(x), mlp.gate_up_proj(x)[..., 128:])


def test_unsupported_architectures_keep_the_transformers_forward():
    sliding = _qwen("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding" in unsupported_reason(sliding.model.model)
    pack_model(sliding, "fp16")
    assert sliding.decoder_path == "transformers"
    assert not any(isinstance(m, ProjectionSlice) for m in sliding.model.modules())
    out = LLM(sliding).generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    native = tiny.loaded()
    assert native.decoder_path == "transformers"  # native weights: the transformers forward
    assert "is not one of" in unsupported_reason(torch.nn.Module())
    assert fuse_projections(torch.nn.Module()) is False
    with pytest.raises(ValueError, match="fuse_projections"):
        FusedDecoder(native.model.model)


def test_no_mask_means_causal_as_in_transformers():
    lm = tiny.loaded(initializer_range=0.3)
    pack_model(lm, "fp16")
    ids, pos = torch.tensor([[5, 9, 11, 3, 7]]), torch.arange(5)[None]
    with torch.no_grad():
        fused = lm.hidden_states(ids, pos, None)
        prefix = lm.hidden_states(ids[:, :3], pos[:, :3], None)
        lm.decoder_forward = None
        ref = lm.hidden_states(ids, pos, None)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[:, :3], prefix, rtol=1e-5, atol=1e-5)  # earlier rows never see later ones


def test_per_layer_helpers_equal_the_reference_formulas():
    """The cheaper per-layer pieces compute transformers' formulas: RMSNorm through LayerNorm of ``[x, -x]``
    (float rounding only), RoPE through roll/addcmul (float rounding only) and SDPA given no mask when every key is
    visible (bit for bit the all-True boolean mask: the forward drops such a mask)."""
    import torch.nn.functional as F

    from unmask.engine.fused_decoder import _cpu_rms_norm, _rotate, _signed_sin

    torch.manual_seed(0)
    weight = torch.rand(96) + 0.5
    norm = _cpu_rms_norm(weight, 1e-6)
    for shape in [(1, 1, 96), (3, 5, 96), (2, 7, 4, 96)]:
        x = torch.randn(shape) * 5
        want = F.rms_norm(x, (96,), weight, 1e-6)
        torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(norm(x[..., ::1].transpose(0, -2).transpose(0, -2)), want, rtol=1e-6, atol=1e-6)
    x, cos, sin = torch.randn(2, 3, 6, 16), torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16)
    want = x * cos + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * sin
    torch.testing.assert_close(_rotate(x, cos, _signed_sin(sin)), want, rtol=1e-6, atol=1e-6)
    for q_len, k_len in [(1, 1), (1, 37), (4, 300), (16, 600)]:
        q, k, v = torch.randn(1, 6, q_len, 16), torch.randn(1, 2, k_len, 16), torch.randn(1, 2, k_len, 16)
        visible = torch.ones(1, 1, q_len, k_len, dtype=torch.bool)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True),
                           F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
