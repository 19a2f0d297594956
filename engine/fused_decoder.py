"""A faster decoder forward for Llama-architecture models whose weights are packed for the CPU.

On the 2-core CPU a one-row decoding step of SmolLM2-135M spent ~40% of its time outside the weight reads: seven
GEMM calls per layer each paying a fixed cost, six-op RMSNorms, ``repeat_kv`` copies for grouped-query attention
and transformers' per-layer dispatch. :func:`fuse_projections` (run on the dense weights, before packing) turns the
q/k/v projections into one linear and gate/up into another; :class:`FusedDecoder` then runs the same computation
as transformers' ``LlamaModel.forward`` (``transformers/models/llama/modeling_llama.py``: RMSNorm, rotary
embedding with ``rotate_half``, SDPA attention, SwiGLU MLP; Qwen2's q/k/v biases and Qwen3's per-head q/k norms
included) with

* 4 GEMMs per layer instead of 7 (q|k|v and gate|up share one weight matrix each),
* RMSNorm through torch's one-kernel LayerNorm (:func:`_cpu_rms_norm`) instead of pow/mean/rsqrt/mul,
* RoPE applied to the query and key heads in one pass (two for Qwen3, whose q/k norms differ) by ``roll`` and
  ``addcmul`` instead of slices, a negation and a concatenation,
* SiLU called as ``F.silu``, not through its module, and
* ``scaled_dot_product_attention(enable_gqa=True)`` instead of repeating the key/value heads, given no mask when
  the forward's mask is all True (one lane, every key visible: block-1 decoding), which gives the masked call's
  result bit for bit through SDPA's cheaper unmasked path.

The results equal the transformers path up to float rounding (the fused GEMM may block its sums differently);
it is used only with fbgemm fp16 weights (:mod:`unmask.engine.packed_weights`), which are approximate already.
The projections' old names stay usable (:class:`ProjectionSlice`), so the transformers forward of a fused model
still computes the same function (slower: each slice runs the fused GEMM). Models of other architectures, with
sliding-window layers, or whose layers do not have the Llama layout keep the transformers forward
(:func:`unsupported_reason` says why).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lane_attention import attend_lanes
from .row_attention import lane_plans, padded_lanes, row_invariant_attention

#: transformers decoder classes whose layer computation is the Llama one (Qwen3 adds per-head q/k RMSNorms)
SUPPORTED_DECODERS = ("LlamaModel", "Qwen2Model", "Qwen3Model")


def unsupported_reason(decoder: nn.Module) -> str | None:
    """Why ``decoder`` (a transformers ``*Model`` decoder stack) cannot run :class:`FusedDecoder`, or None."""
    name = type(decoder).__name__
    if name not in SUPPORTED_DECODERS:
        return f"{name} is not one of {', '.join(SUPPORTED_DECODERS)}"
    cfg = decoder.config
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention layers"
    for i, layer in enumerate(decoder.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"layer {i} has no q/k/v/o projections"
        if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"layer {i} has no gate/up/down MLP"
    return None


class ProjectionSlice(nn.Module):
    """Stands in for one of the projections merged into ``owner.<fused_name>``: ``forward(x)`` returns output
    features ``[start, end)`` of the fused projection (the whole fused GEMM runs; used only by code that calls the
    old projection names, e.g. the transformers forward). The owner is not registered as a submodule, so the fused
    weights are packed, counted and saved once."""

    def __init__(self, owner: nn.Module, fused_name: str, start: int, end: int, in_features: int):
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        self.fused_name, self.start, self.end, self.in_features = fused_name, start, end, in_features
        self.out_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self._owner, self.fused_name)(x)[..., self.start:self.end]

    def extra_repr(self) -> str:
        return f"{self.fused_name}[{self.start}:{self.end}]"


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A float32 ``nn.Linear`` holding ``weight`` ``[out, in]`` and ``bias`` (no gradients)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin.requires_grad_(False)


def dense_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [out, in] float32, bias [out] float32 | None)`` of a linear layer, bitsandbytes layers
    dequantized; ``None`` for a module that is not a linear layer this module knows."""
    if type(module) is nn.Linear:
        w = module.weight.detach()
    else:
        name = type(module).__name__
        if name == "Linear4bit":
            import bitsandbytes.functional as bnbf

            w = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif name == "Linear8bitLt":
            cb, scb = getattr(module.weight, "CB", None), getattr(module.weight, "SCB", None)
            if cb is None or scb is None:  # after a forward bitsandbytes keeps them in the layer's state
                cb, scb = module.weight.data, getattr(getattr(module, "state", None), "SCB", None)
            if scb is None or cb.dtype != torch.int8:
                raise ValueError(f"weights: cannot dequantize this {name} layer (no int8 weight with row scales)")
            w = cb.float() * (scb.float()[:, None] / 127.0)
        else:
            return None
    bias = module.bias.detach().float() if getattr(module, "bias", None) is not None else None
    return w.float(), bias


def _is_linear(module: nn.Module) -> bool:
    """A linear layer whose dense weights :func:`dense_weight` can read."""
    return type(module) is nn.Linear or type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def _fusable(modules: list[nn.Module]) -> bool:
    """Whether ``modules`` are all linear layers (or all verifier-routed pairs of linear layers sharing one router)
    with the same input size; reads shapes and types only."""
    from .routed import RoutedModule

    if all(isinstance(m, RoutedModule) for m in modules):
        if len({id(m.router) for m in modules}) != 1:
            return False
        return _fusable([m.drafter for m in modules]) and _fusable([m.verifier for m in modules])
    if not all(_is_linear(m) for m in modules):
        return False
    return len({_in_features(m) for m in modules}) == 1


def _concat_linear(modules: list[nn.Module], make_linear) -> nn.Module:
    """``make_linear(weight, bias)`` of the concatenation of ``modules``' output features, in order (dense float32
    weights; nf4/int8 bitsandbytes layers dequantized; a missing bias is zeros when another has one)."""
    parts = [dense_weight(m) for m in modules]
    weight = torch.cat([w for w, _ in parts])
    bias = None
    if any(b is not None for _, b in parts):
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])
    return make_linear(weight, bias)


def _fuse(modules: list[nn.Module], make_linear) -> nn.Module:
    """The fused projection of :func:`_fusable` ``modules``: one linear, or for verifier-routed layers
    (:class:`unmask.engine.routed.RoutedModule`) a routed pair of them."""
    from .routed import RoutedModule

    if isinstance(modules[0], RoutedModule):
        return RoutedModule(_concat_linear([m.drafter for m in modules], make_linear),
                            _concat_linear([m.verifier for m in modules], make_linear), modules[0].router)
    return _concat_linear(modules, make_linear)


def _merge(owner: nn.Module, names: tuple[str, ...], fused_name: str, make_linear) -> None:
    """Replace ``owner.<names>`` by one ``owner.<fused_name>`` plus :class:`ProjectionSlice` stand-ins."""
    modules = [getattr(owner, n) for n in names]
    sizes = [_out_features(m) for m in modules]
    in_features = _in_features(modules[0])
    setattr(owner, fused_name, _fuse(modules, make_linear))
    start = 0
    for n, size in zip(names, sizes):
        setattr(owner, n, ProjectionSlice(owner, fused_name, start, start + size, in_features))
        start += size


def _dense_shape(module: nn.Module) -> tuple[int, int]:
    """``(out, in)`` of a (possibly routed, possibly bitsandbytes) linear layer."""
    from .routed import RoutedModule

    if isinstance(module, RoutedModule):
        module = module.drafter
    w = module.weight
    state = getattr(w, "quant_state", None)
    if state is not None:
        return int(state.shape[0]), int(state.shape[1])
    return int(w.shape[0]), int(w.shape[1])


def _out_features(module: nn.Module) -> int:
    return _dense_shape(module)[0]


def _in_features(module: nn.Module) -> int:
    return _dense_shape(module)[1]


def fuse_projections(decoder: nn.Module, make_linear=_dense_linear) -> bool:
    """Merge, in place, every layer's q/k/v projections into ``self_attn.qkv_proj`` and gate/up into
    ``mlp.gate_up_proj`` (routed layers stay routed).

    Args:
        decoder: a transformers decoder stack (``LlamaModel``, ``Qwen2Model``, ``Qwen3Model``).
        make_linear: ``(weight [out, in] float32, bias [out] | None) -> module`` building each fused layer; the
            default is a float32 ``nn.Linear``; ``packed_weights.pack_model`` passes the fp16 packer, so that one
            layer at a time exists in float32 (an nf4 checkpoint is never dequantized whole).

    Returns:
        True when every layer was fused (the model can run :class:`FusedDecoder`); False (nothing changed) when
        :func:`unsupported_reason` names a reason or a layer's projections are not plain or routed linear layers.
    """
    if unsupported_reason(decoder) is not None:
        return False
    groups = [(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj") for layer in decoder.layers]
    groups += [(layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj") for layer in decoder.layers]
    if not all(_fusable([getattr(owner, n) for n in names]) for owner, names, _ in groups):
        return False
    for owner, names, fused_name in groups:
        _merge(owner, names, fused_name, make_linear)
    return True


def _norm_function(module: nn.Module):
    """``f(x)`` for a norm module: a transformers RMSNorm (``*RMSNorm`` with ``weight`` and ``variance_epsilon``)
    through torch's fused kernel, any other norm (routed ones included) through its own forward."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None or not type(module).__name__.endswith("RMSNorm"):
        return module
    weight = module.weight
    if weight.dtype == torch.float32 and weight.device.type == "cpu":
        return _cpu_rms_norm(weight, float(eps))

    def norm(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)

    return norm


def _cpu_rms_norm(weight: torch.Tensor, eps: float):
    """RMSNorm ``x * rsqrt(mean(x^2) + eps) * weight`` of float32 ``[..., H]`` CPU tensors through torch's fused
    LayerNorm kernel: LayerNorm of ``[x, -x]`` (mean 0, variance ``mean(x^2)``) with weight ``[w, 0]``, first half.
    On the 2-core CPU measured ``torch.rms_norm`` runs as ~6 separate kernels (~7 us per 576-wide row) and this as
    2 + one kernel (~5 us); results differ from ``rms_norm`` by float rounding only (the variance is summed in
    another order; measured relative difference ~3e-9)."""
    H = int(weight.shape[-1])
    shape, doubled = (2 * H,), torch.cat([weight.detach(), weight.new_zeros(H)])

    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.layer_norm(torch.cat((x, x.neg()), dim=-1), shape, doubled, None, eps)[..., :H]

    return norm


def _linear_function(module: nn.Module):
    """``f(x)`` for a projection: packed layers called without ``nn.Module`` overhead, others as modules."""
    as_function = getattr(module, "as_function", None)
    return as_function() if as_function is not None else module


def _activation_function(module: nn.Module):
    """``f(x)`` for an MLP activation: SiLU (torch's or transformers' ``SiLUActivation``) as ``F.silu`` without
    ``nn.Module`` call overhead, any other activation as its module."""
    return F.silu if type(module).__name__ in ("SiLU", "SiLUActivation") else module


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` sin with its first half negated: ``rotate_half(x) * sin == roll(x, D/2) * _signed_sin(sin)``
    (``rotate_half(x) = cat(-x2, x1)``; a sign moved between factors changes no bit of the product)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[B, Q, H, D]`` heads with ``[B, Q, 1, D]`` cos and :func:`_signed_sin` (transformers'
    ``x*cos + rotate_half(x)*sin`` in three calls instead of seven; the sum may be fused, one rounding)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


class FusedDecoder:
    """Forward of a decoder stack fused by :func:`fuse_projections` (see the module docstring).

    ``__call__(input_ids, position_ids, attention_mask, cache)`` takes ``[B, Q]`` int64 ids and positions, a
    boolean ``[B, 1, Q, C + Q]`` mask (True = may attend; C = keys cached in ``cache``, a
    :class:`~unmask.engine.kv_cache.BatchKV` or None; None = causal, as transformers) and returns the final-norm hidden states ``[B, Q, hidden]``,
    as ``LlamaModel.forward(...).last_hidden_state`` would.

    ``row_invariant``: attention through :mod:`unmask.engine.row_attention` (a row's result independent of the
    other rows and lanes; one call per lane and group), for the low-bit formats whose bf16 inputs amplify SDPA's
    last-bit differences; ``prompt_rows`` (``[B, Q]`` bool, the committed prompt rows) are then computed in its
    fixed prompt tiles.

    Build it after the weights are packed: each layer's norms and projections are resolved once into plain
    functions (a one-row step calls ~10 per layer, where ``nn.Module`` dispatch is a visible share).

    Raises:
        ValueError: the decoder was not fused.
    """

    def __init__(self, decoder: nn.Module, row_invariant: bool = False):
        layer0 = decoder.layers[0] if len(decoder.layers) else None
        if layer0 is None or not hasattr(layer0.self_attn, "qkv_proj") or not hasattr(layer0.mlp, "gate_up_proj"):
            raise ValueError("FusedDecoder: run fuse_projections(decoder) first")
        self.decoder = decoder
        self.row_invariant = bool(row_invariant)
        self.prompt_tiles = True  # with row_invariant: prompt rows in prompt tiles (a benchmark switches it off)
        self.lane_attention = True  # without row_invariant: a lane-mode cache is read per lane, in place
        cfg = decoder.config
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(layer0.self_attn.head_dim)
        self.final_norm = _norm_function(decoder.norm)
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                _norm_function(layer.input_layernorm), _linear_function(attn.qkv_proj),
                _norm_function(attn.q_norm) if hasattr(attn, "q_norm") else None,
                _norm_function(attn.k_norm) if hasattr(attn, "k_norm") else None,
                float(attn.scaling), _linear_function(attn.o_proj),
                _norm_function(layer.post_attention_layernorm), _linear_function(mlp.gate_up_proj),
                _activation_function(mlp.act_fn), _linear_function(mlp.down_proj)))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 cache=None, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        dec = self.decoder
        B, Q = input_ids.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if attention_mask is None:  # as transformers: causal over the cached keys and the chunk
            C = cache.get_seq_length() if cache is not None else 0
            attention_mask = torch.ones(Q, C + Q, dtype=torch.bool, device=input_ids.device).tril(C)[None, None]
        x = dec.embed_tokens(input_ids)
        cos, sin = dec.rotary_emb(x, position_ids=position_ids)  # [B, Q, D]
        cos, sin = cos[:, :, None].to(x.dtype), _signed_sin(sin[:, :, None].to(x.dtype))
        row_plan = None
        if self.row_invariant:  # per lane and group (its unmasked calls are the one-lane calls bit for bit)
            cached = 0 if cache is None else getattr(cache, "cached_len", None)
            if cached is None:  # a transformers cache (benchmarks' bare forward): every lane equally long
                cached = cache.get_seq_length()
            lengths = [lane.length for lane in cache.lanes] if hasattr(cache, "lane_update") else [cached] * B
            row_plan = lane_plans(attention_mask.expand(B, -1, -1, -1), cached, position_ids, prompt_rows, lengths)
        elif bool(attention_mask.all()):  # nothing masked (one lane, every key visible): SDPA's unmasked path
            attention_mask = None
        gqa = Hq != Hkv
        qk_v, q_k = (Hq + Hkv, Hkv), (Hq, Hkv)
        sdpa = F.scaled_dot_product_attention
        for i, (in_norm, qkv_proj, q_norm, k_norm, scaling, o_proj, post_norm, gate_up_proj, act, down_proj) \
                in enumerate(self.layers):
            qk, v = qkv_proj(in_norm(x)).view(B, Q, Hq + 2 * Hkv, D).split(qk_v, dim=2)
            if q_norm is not None:  # Qwen3: RMSNorm over each head before RoPE
                q, k = qk.split(q_k, dim=2)
                q, k = _rotate(q_norm(q), cos, sin), _rotate(k_norm(k), cos, sin)
            else:
                q, k = _rotate(qk, cos, sin).split(q_k, dim=2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if row_plan is not None:  # each lane's own keys (a decoding lane's are a view of its cache buffer)
                if hasattr(cache, "lane_update"):
                    lane_kv = cache.lane_update(k, v, i)
                else:
                    lane_kv = padded_lanes(*(cache.update(k, v, i) if cache is not None else (k, v)), row_plan)
                o = row_invariant_attention(q, lane_kv, row_plan, scaling, gqa)
            else:
                if cache is not None:
                    k, v = cache.update(k, v, i)
                if getattr(cache, "lane_mode", False):  # each lane over its own KV blocks (engine/lane_attention.py)
                    o = attend_lanes(cache, i, q, k, v, attention_mask, scaling).transpose(1, 2)
                else:
                    o = sdpa(q, k, v, attn_mask=attention_mask, scale=scaling, enable_gqa=gqa)
            x = x + o_proj(o.transpose(1, 2).reshape(B, Q, Hq * D))
            gate, up = gate_up_proj(post_norm(x)).chunk(2, dim=-1)
            x = x + down_proj(act(gate) * up)
        return self.final_norm(x)

