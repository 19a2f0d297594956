"""The LLaDA2.x / LLaDA-MoE architecture (inclusionAI's ``LLaDA2MoeModelLM``, ``model_type: llada2_moe``), written
for unmask: transformers has no class for it and its checkpoints ship remote code we never run
(docs/design.md#model-families). Checked against the public modeling code (inclusionAI's dInfer
``python/dinfer/model/modeling_llada2_moe.py`` and the HF repositories' copy) and the LLaDA2.0-mini config; the
family adapter (``unmask.engine.families.llada2``) reads the checkpoint onto it.

Per decoder layer (pre-norm, RMSNorm computed in float32):

* attention: one fused ``query_key_value`` projection to ``Hq + 2 Hkv`` heads of ``head_dim`` (grouped KV heads;
  a bias when ``use_qkv_bias``), per-head RMS ``query_layernorm`` / ``key_layernorm`` (``use_qk_norm``), RoPE
  (``rope_theta``) on the first ``head_dim * partial_rotary_factor`` dims of each head (``rotate_half`` layout, the
  rest passes through), scaled dot-product attention under the engine's boolean mask, output ``dense``;
* feed-forward: a dense SwiGLU (``intermediate_size``) in the first ``first_k_dense_replace`` layers, else the MoE
  layer of :mod:`unmask.engine.moe` (``num_experts``, ``num_experts_per_tok``, group-limited routing ``n_group`` /
  ``topk_group``, ``score_function``, ``norm_topk_prob``, ``routed_scaling_factor``, ``num_shared_experts`` shared
  experts of ``moe_intermediate_size`` each, the router's ``expert_bias``).

Then ``model.norm`` and ``lm_head`` (tied to ``model.word_embeddings`` when ``tie_word_embeddings``). The attention
is whatever mask the caller passes: the engine's block-causal masks (``unmask.engine.attention``), so the model is
LLaDA2's block diffusion; the cache is the engine's duck-typed ``BatchKV`` (``update(k, v, layer)``; in its lane
mode, set by ``load_model``, each lane attends over its own cached keys through ``unmask.engine.lane_attention``).

Shapes: ``input_ids``/``position_ids`` ``[B, Q]`` int64, mask ``[B, 1, Q, C + Q]`` bool (True = may attend),
hidden ``[B, Q, H]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .moe import MoeLayer, MoeSpec, SwiGLU

__all__ = ["Llada2Config", "Llada2ForDiffusion"]


@dataclass
class Llada2Config:
    """The ``config.json`` keys of ``LLaDA2MoeModelLM`` this architecture reads (names as in the checkpoint)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    score_function: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    use_qkv_bias: bool = False
    use_qk_norm: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (even)."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    def moe_spec(self) -> MoeSpec:
        """The :class:`~unmask.engine.moe.MoeSpec` of every MoE layer. Raises ValueError naming the key."""
        return MoeSpec(hidden=self.hidden_size, intermediate=self.moe_intermediate_size, num_experts=self.num_experts,
                       top_k=self.num_experts_per_tok, n_group=self.n_group, topk_group=self.topk_group,
                       score_function=self.score_function, norm_topk_prob=bool(self.norm_topk_prob),
                       routed_scaling_factor=float(self.routed_scaling_factor),
                       shared_intermediate=self.moe_intermediate_size * self.num_shared_experts)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, the normalisation in float32, cast back before the weight (LLaDA2's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[B, Q, rotary_dim]`` for ``[B, Q]`` positions (computed in float32, cast to ``dtype``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=position_ids.device) / rotary_dim))
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of ``[B, h, Q, D]`` heads (``rotate_half`` layout)."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None] + rotated * sin[:, None]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class Llada2Attention(nn.Module):
    def __init__(self, cfg: Llada2Config, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, (Hq + 2 * Hkv) * D, bias=cfg.use_qkv_bias)
        self.dense = nn.Linear(Hq * D, cfg.hidden_size, bias=False)
        if cfg.use_qk_norm:
            self.query_layernorm = RMSNorm(D, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache=None) -> torch.Tensor:
        cfg = self.cfg
        B, Q, _ = x.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = self.query_key_value(x).view(B, Q, Hq + 2 * Hkv, D).transpose(1, 2)
        q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
        if cfg.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            if getattr(cache, "lane_mode", False):  # each lane's own cached keys (engine/lane_attention.py)
                from .lane_attention import lane_attention

                out, _ = lane_attention(self, q, k, v, mask, scaling=1.0 / math.sqrt(D))
                return self.dense(out.reshape(B, Q, Hq * D))
        if mask is None:  # transformers' meaning of no mask: causal (over the cached keys too)
            C = k.shape[2] - Q
            mask = torch.ones(Q, C + Q, dtype=torch.bool, device=x.device).tril(C)[None, None]
        out = F.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), attn_mask=mask,
                                             scale=1.0 / math.sqrt(D), enable_gqa=Hq != Hkv)
        return self.dense(out.transpose(1, 2).reshape(B, Q, Hq * D))


class Llada2Layer(nn.Module):
    def __init__(self, cfg: Llada2Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Llada2Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SwiGLU(cfg.hidden_size, cfg.intermediate_size) if layer_idx < cfg.first_k_dense_replace
                    else MoeLayer(cfg.moe_spec()))

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.attention(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llada2Model(nn.Module):
    """The decoder stack (``model.*``): ``forward(input_ids, position_ids, attention_mask, past_key_values)`` ->
    an object with ``last_hidden_state`` ``[B, Q, H]`` (the interface ``LoadedModel.hidden_states`` calls)."""

    def __init__(self, cfg: Llada2Config):
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Llada2Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                **_unused) -> SimpleNamespace:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        x = self.word_embeddings(input_ids)
        cos, sin = rope(position_ids, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention_mask, past_key_values)
        return SimpleNamespace(last_hidden_state=self.norm(x))


class Llada2ForDiffusion(nn.Module):
    """``model`` (:class:`Llada2Model`) + ``lm_head``; ``forward(input_ids, attention_mask=None, position_ids=None)``
    -> an object with ``logits`` ``[B, Q, V]`` (float32), so that a caller that wants logits (diffusers'
    ``LLaDA2Pipeline``, given the block-causal mask) can call it directly."""

    def __init__(self, cfg: Llada2Config):
        super().__init__()
        self.config = cfg
        self.model = Llada2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.word_embeddings.weight

    @property
    def base_model(self) -> Llada2Model:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **_unused) -> SimpleNamespace:
        hidden = self.model(input_ids, position_ids, attention_mask).last_hidden_state
        return SimpleNamespace(logits=self.lm_head(hidden).float())
