"""Tiny random DiffusionGemma replicas (transformers 5.25's ``DiffusionGemmaForBlockDiffusion``), saved in the
checkpoint's own layout (``save_pretrained``: ``model_type: diffusion_gemma``, tied encoder/decoder weights, a
vision tower) with a tokenizer, built on the fly."""
from __future__ import annotations

import torch

from tiny import make_tokenizer

VOCAB = 320
EOS = 0  # the test tokenizer's <|endoftext|>


def tiny_config(canvas_length: int = 8, vocab_size: int = VOCAB, **text):
    """A ``DiffusionGemmaConfig`` at tiny sizes: 3 layers (sliding, sliding, full; the full layer with its own head
    size and one KV head, keys as values), 4 experts top-2 beside the dense MLP, a 1-layer vision tower."""
    from transformers import DiffusionGemmaConfig, Gemma4VisionConfig
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=1, sliding_window=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_experts=4,
              top_k_experts=2, moe_intermediate_size=32, max_position_embeddings=512, pad_token_id=EOS,
              eos_token_id=EOS, bos_token_id=EOS)
    kw.update(text)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, position_embedding_size=16, patch_size=4)
    return DiffusionGemmaConfig(text_config=DiffusionGemmaTextConfig(**kw), vision_config=vision,
                                canvas_length=canvas_length, eos_token_id=EOS, pad_token_id=EOS)


def random_diffusion_gemma(cfg, seed: int = 0, scale: float = 1.0):
    """A ``DiffusionGemmaForBlockDiffusion`` of ``cfg`` with deterministic random weights (linear ``N(0, 1/fan_in)``,
    norms ``1 + 0.1 N``, embeddings ``N(0, scale)``: the tied head's logits are decisive, so the entropy bound
    accepts several tokens a step and adaptive stopping fires)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if name.endswith("norm.weight") or name.endswith(".scale") or name.endswith("per_expert_scale"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def save_replica(out, canvas_length: int = 8, seed: int = 0, scale: float = 1.0, **text):
    """Save a tiny replica (weights, config, generation config, tokenizer) to ``out``; returns the model."""
    cfg = tiny_config(canvas_length, **text)
    model = random_diffusion_gemma(cfg, seed, scale)
    model.save_pretrained(out)
    tok = make_tokenizer(VOCAB)
    tok.save_pretrained(out)
    return model


def reference_generate(model, prompt_ids: list[int], seed: int, **kwargs) -> list[int]:
    """transformers' ``generate()`` at batch 1 with ``torch.manual_seed(seed)``: the generated ids up to and
    including the first EOS (the pads after it dropped)."""
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt_ids]), **kwargs).sequences[0, len(prompt_ids):].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out
