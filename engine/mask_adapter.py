"""The mask-row adapter: a LoRA delta that only the mask rows of a forward see (docs/design.md#mask-row-adapter).

An A2D checkpoint can be its AR parent plus a low-rank delta ``scale * B A`` (LoRA, Hu et al. 2021,
arXiv:2106.09685; rank ``r``, ``scale = alpha / r``) on chosen linear layers, applied **only on variant rows**:
the non-committed rows of a forward (the active block's mask rows in plain diffusion decoding, the mask and
fallback groups of a speculative step). Committed and causal rows run the parent's weights through the very same
modules and kernels: every adapted layer computes ``y = base(x)`` for all rows in one weight read (the fp16-packed
fbgemm GEMM on a CPU, or the plain linear), then adds ``scale * (x_sel A^T) B^T`` to the selected rows only, as a
separate small GEMM. Because committed rows never attend to non-committed ones (prefix-causal mask), their keys,
values and logits are the parent's bit for bit; ``block_size=1`` decoding (which forwards only committed tokens)
is the parent's decoding, and speculative verification (the causal rows) is the parent's own greedy/sampling,
while the adapter drafts. Per-row adapters in one batch follow multi-LoRA serving (Punica, S-LoRA).

The mask token's input embedding is part of the adapter too (``mask_embedding``, ``[H]``): the embedding module is
wrapped so that mask-token inputs read it; the LM head (tied or not) is untouched.

This module is the :class:`~unmask.engine.model.RowVariant` (:class:`MaskAdapter`, ``rows = "uncommitted"``: the
denoiser marks the valid non-committed rows), the adapted linear (:class:`MaskLoRALinear`, also what training
trains), :func:`attach_mask_adapter` (native or packed/fused models) and the weights' container
(:class:`AdapterWeights`). Files and parents: :mod:`unmask.engine.adapter_files`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .transfer import to_device

#: the linear layers a default adapter adapts (Llama names; every projection of attention and MLP)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: where each target lives in a decoder layer, and the fused projection it is part of after packing
_OWNER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class MaskAdapter:
    """The row-variant state of one model: the flat indices of the rows that see the adapter in this forward.

    ``rows = "uncommitted"`` tells the denoiser which rows are variant rows (valid, non-committed ones), whatever
    the decoding strategy. ``index`` is None outside :meth:`select` (every row runs the parent's weights).
    """

    rows = "uncommitted"

    def __init__(self, weights: "AdapterWeights") -> None:
        # the settings only: the tensors live in the wrappers (holding them here kept a second float32 copy of
        # every unfused A/B alive, 19.5 MB on the shipped default)
        self.weights = dataclasses.replace(weights, layers={}, mask_embedding=None)
        self.index: torch.Tensor | None = None  # [n] int64 flat row indices, set per forward
        self.shape: tuple[int, ...] | None = None
        self.row_mask: torch.Tensor | None = None  # [N, 1] bool: the variant rows of a small forward, else None

    @contextlib.contextmanager
    def select(self, variant_rows: torch.Tensor, host: torch.Tensor | None = None):
        """The :class:`~unmask.engine.model.RowVariant` seam: inside, the True rows of ``variant_rows`` (bool,
        ``[B, Q]`` in the decoder) get the adapter's delta (``host``: the same rows on the CPU: the indices are then
        found there and copied, no device read)."""
        flat = variant_rows.reshape(-1)
        off_cpu = flat.device.type != "cpu"
        if host is not None:  # off the CPU the dense delta needs no indices: they stay on the host (a flag)
            found = host.reshape(-1).nonzero().flatten()
            self.index = (found if off_cpu else to_device(found, flat.device)) if found.numel() else None
        else:
            self.index = flat.nonzero().flatten() if bool(flat.any()) else None
        self.shape = tuple(variant_rows.shape)
        dense = flat.numel() <= DENSE_DELTA_ROWS or off_cpu
        self.row_mask = flat[:, None] if self.index is not None and dense else None
        try:
            yield
        finally:
            self.index = self.shape = self.row_mask = None


#: rows per adapter GEMM at inference (every call has exactly this many rows; see :func:`_fixed_chunk_linear`)
DELTA_CHUNK = 16
#: forwards of at most this many rows (plain decoding steps, small speculative steps) compute the delta on every
#: row in one chunk and keep it on the variant rows (:func:`_dense_delta`); longer ones gather the variant rows first
#: (a block-4 speculative step forwards ~24 rows of which ~16 are mask rows: one chunk gathered, two dense).
#: Off the CPU every forward takes the dense path in one GEMM per factor (:func:`_fixed_chunk_linear`): on a GPU the
#: launches cost more than the rank-``r`` FLOPs of the unselected rows, and no gather/scatter runs.
DENSE_DELTA_ROWS = DELTA_CHUNK


def execution_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: accelerate's execution device when a device map offloaded it (its weights then
    sit on ``meta`` or the CPU), else the device of its first parameter or buffer, else the CPU."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device("cuda", hook_device) if isinstance(hook_device, int) else torch.device(hook_device)
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _fixed_chunk_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[n, in]`` float32 and ``w`` ``[out, in]`` float32, computed in GEMMs of exactly
    :data:`DELTA_CHUNK` rows (the last chunk zero-padded) -> ``[n, out]`` float32. Off the CPU: one GEMM (one launch;
    cuBLAS picks kernels by shape too, but a GPU claims no batch invariance in float32, only ≈32:
    docs/design.md#exactness-contracts-by-device-and-dtype).

    Batch invariance (docs/design.md#decisions): MKL's float32 GEMM picks its kernel by the row count, so one GEMM
    over all selected rows made a mask row's delta depend on how many rows were selected; with a fixed shape a row's
    result depends on its own values only (``tests/engine/test_mask_adapter.py`` checks it across positions and
    batch mates). One ``[1, in]`` product per row (``bmm`` over stride-0 weights) had the same property at ~30x
    the cost (docs/adapter.md, "Adapter delta cost").
    """
    if x.device.type != "cpu":
        return torch.nn.functional.linear(x, w)
    n = x.shape[0]
    pad = (-n) % DELTA_CHUNK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = [torch.nn.functional.linear(c, w) for c in x.split(DELTA_CHUNK)]
    return (out[0] if len(out) == 1 else torch.cat(out))[:n]


def _dense_delta(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                 row_mask: torch.Tensor) -> torch.Tensor:
    """``y`` plus the adapter delta ``scale * (x A^T) B^T`` on the rows of ``row_mask`` (``[N, 1]`` bool over the
    ``N`` flattened rows of ``x`` ``[..., in]`` / ``y`` ``[..., out]``), the other rows ``y``'s own values bit for
    bit (``torch.where``). Inference only (no gradients).

    The same per-row arithmetic as the gathered path of :meth:`MaskLoRALinear.forward` (GEMMs of exactly
    :data:`DELTA_CHUNK` rows, :func:`_fixed_chunk_linear`), without its gather/scatter: on the 2-core CPU measured a speculative step spent about as long in the
    120 projections' gather, padding, scatter and module dispatch as in its weight GEMMs (docs/adapter.md,
    "Adapter delta cost"). Every row costs the delta's FLOPs, so only short forwards (:data:`DENSE_DELTA_ROWS`)
    take this path."""
    flat_x = x.reshape(-1, x.shape[-1]).float()
    n = flat_x.shape[0]
    delta = _fixed_chunk_linear(_fixed_chunk_linear(flat_x, a), b) * scale
    flat_y = y.reshape(n, y.shape[-1])
    return torch.where(row_mask, flat_y + delta.to(y.dtype), flat_y).reshape(y.shape)


class MaskLoRALinear(nn.Module):
    """``base(x)`` on every row, plus ``scale * (x A^T) B^T`` on the rows of ``state.index``.

    At inference the delta runs in GEMMs of a fixed row count (:func:`_fixed_chunk_linear`): MKL's float32 GEMM of
    the selected rows as one matrix picked other kernels by row count (K >= 128), so a mask row's logits depended
    on its batch mates; with a fixed shape they do not (batch invariance, docs/design.md#decisions).

    Args:
        base: any linear module ``[..., in] -> [..., out]`` (``nn.Linear``, a packed fp16 linear, a fused
            projection); its weights are never changed.
        a: ``[r, in]`` float32; b: ``[out, r]`` float32 (a fused projection: ``A`` stacked, ``B`` block-diagonal).
        scale: ``alpha / r``. state: the model's :class:`MaskAdapter` (or any object with ``index``/``shape``).
        trainable: make ``a``/``b`` parameters with gradients (training), else frozen.

    Raises ``RuntimeError`` when the selected rows do not match ``x``'s leading dimensions.
    """

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float, state,
                 trainable: bool = False):
        super().__init__()
        self.base = base
        home = execution_device(base)  # the adapter runs where its layer runs (docs/design.md#devices)
        self.lora_A = nn.Parameter(a.detach().to(home, torch.float32, copy=True), requires_grad=trainable)
        self.lora_B = nn.Parameter(b.detach().to(home, torch.float32, copy=True), requires_grad=trainable)
        self.scale = float(scale)
        object.__setattr__(self, "_state", state)  # shared, not a submodule

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (for code that reads ``module.weight``)."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        idx = self._state.index
        if idx is None:
            return y
        lead = x.shape[:-1]
        if tuple(lead) != self._state.shape:
            raise RuntimeError(f"mask adapter: variant rows {self._state.shape} do not match input {tuple(x.shape)}")
        row_mask = getattr(self._state, "row_mask", None)
        training = torch.is_grad_enabled() and (x.requires_grad or self.lora_A.requires_grad)
        if row_mask is not None and not training:  # no gather/scatter (short forwards; every forward off the CPU)
            return _dense_delta(x, y, self.lora_A, self.lora_B, self.scale, row_mask)
        flat_x = x.reshape(-1, x.shape[-1])
        sel = flat_x.index_select(0, idx)
        if training:
            delta = ((sel.float() @ self.lora_A.t()) @ self.lora_B.t()) * self.scale
        else:  # fixed-shape GEMMs: a row's delta does not depend on how many rows are selected
            delta = _fixed_chunk_linear(_fixed_chunk_linear(sel.float(), self.lora_A), self.lora_B) * self.scale
        flat_y = y.reshape(-1, y.shape[-1])
        if torch.is_grad_enabled() and (delta.requires_grad or flat_y.requires_grad):
            return flat_y.index_add(0, idx, delta.to(y.dtype)).reshape(y.shape)
        flat_y.index_add_(0, idx, delta.to(y.dtype))  # in place: the base output is not needed elsewhere
        return flat_y.reshape(y.shape)

    def as_function(self):
        """``f(x) == self(x)``, for the fused decoder's per-layer plans: a forward without mask rows (``index`` None:
        every block-1 step and causal-only forward) calls the base layer's own function directly, without the two
        ``nn.Module`` dispatches per call (docs/adapter.md, "Block 1 of the adapter model")."""
        base = getattr(self.base, "as_function", None)
        base = base() if base is not None else self.base
        state = self._state
        a, b = self.lora_A, self.lora_B

        def run(x: torch.Tensor) -> torch.Tensor:
            if state.index is None:
                return base(x)
            if state.row_mask is None or torch.is_grad_enabled() and (x.requires_grad or a.requires_grad):
                return self(x)
            if tuple(x.shape[:-1]) != state.shape:
                raise RuntimeError(f"mask adapter: variant rows {state.shape} do not match input {tuple(x.shape)}")
            return _dense_delta(x, base(x), a, b, self.scale, state.row_mask)

        return run

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.shape[0]}, scale={self.scale:g}, mask rows only"


class MaskEmbedding(nn.Module):
    """The input embedding, with the mask token's row read from ``mask_vector`` (``[H]``) instead of the table.

    ``forward(ids [...]) -> [..., H]``; every other token is the wrapped embedding's output unchanged.
    """

    def __init__(self, base: nn.Module, mask_token_id: int, mask_vector: torch.Tensor, trainable: bool = False):
        super().__init__()
        self.base = base
        self.mask_token_id = int(mask_token_id)
        self.mask_vector = nn.Parameter(mask_vector.detach().to(execution_device(base), torch.float32, copy=True),
                                        requires_grad=trainable)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.base(ids)
        is_mask = (ids == self.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_vector.to(out.dtype), out)


@dataclass
class AdapterWeights:
    """An adapter's tensors and settings.

    Attributes:
        rank, alpha: LoRA rank ``r`` and ``alpha`` (scale ``alpha / r``). targets: adapted projection names.
        mask_token_id: the parent's mask id. layers: ``{(layer, target): (A [r, in], B [out, r])}`` float32.
        mask_embedding: ``[H]`` float32 or None (the parent's row).
        stored_dtype: the dtype of the tensors on disk (``float16`` or ``float32``); the values are kept exactly
            (fp16 -> float32 is exact) whatever the parent's weight format (nf4, int8, int4): never re-quantized.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]
    mask_token_id: int
    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    mask_embedding: torch.Tensor | None = None
    stored_dtype: str = "float32"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def n_parameters(self) -> int:
        n = sum(a.numel() + b.numel() for a, b in self.layers.values())
        return n + (self.mask_embedding.numel() if self.mask_embedding is not None else 0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors for safetensors: ``layers.<i>.<target>.lora_A|lora_B`` and ``mask_embedding``."""
        out = {}
        for (i, t), (a, b) in sorted(self.layers.items()):
            out[f"layers.{i}.{t}.lora_A"] = a.detach().float().contiguous().cpu()
            out[f"layers.{i}.{t}.lora_B"] = b.detach().float().contiguous().cpu()
        if self.mask_embedding is not None:
            out["mask_embedding"] = self.mask_embedding.detach().float().contiguous().cpu()
        return out


def init_adapter(decoder: nn.Module, rank: int, alpha: float, targets=DEFAULT_TARGETS, mask_token_id: int = 0,
                 generator: torch.Generator | None = None) -> AdapterWeights:
    """A fresh adapter for ``decoder`` (a transformers decoder stack, unfused): ``A`` Kaiming-uniform as peft
    does, ``B`` zeros (so the adapter starts as the identity), the mask embedding from the parent's row.

    Raises:
        ValueError: ``rank < 1`` or a target that is not a projection of every layer (names the field).
    """
    if rank < 1:
        raise ValueError(f"lora_rank: must be >= 1, got {rank}")
    bad = [t for t in targets if t not in _OWNER]
    if bad:
        raise ValueError(f"lora_targets: {bad} are not among {list(_OWNER)}")
    w = AdapterWeights(rank=int(rank), alpha=float(alpha), targets=tuple(targets), mask_token_id=int(mask_token_id))
    for i, layer in enumerate(decoder.layers):
        for t in targets:
            mod = getattr(getattr(layer, _OWNER[t]), t)
            out_f, in_f = _shape(mod)
            a = torch.empty(rank, in_f)
            bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on [r, in], as peft's LoRA A
            a.uniform_(-bound, bound, generator=generator)
            w.layers[(i, t)] = (a, torch.zeros(out_f, rank))
    emb = decoder.embed_tokens
    emb = getattr(emb, "base", emb)
    w.mask_embedding = emb.weight[int(mask_token_id)].detach().float().clone()
    return w


def projection_shapes(decoder: nn.Module, targets=DEFAULT_TARGETS) -> dict[tuple[int, str], tuple[int, int]]:
    """``{(layer, target): (out, in)}`` of ``decoder``'s projections (plain, packed, quantized, or the slices of a
    fused projection): the shapes an adapter's ``B A`` must have (:mod:`unmask.engine.adapter_check`)."""
    return {(i, t): _shape(getattr(getattr(layer, _OWNER[t]), t))
            for i, layer in enumerate(decoder.layers) for t in targets}


def _shape(module: nn.Module) -> tuple[int, int]:
    """``(out, in)`` of a linear module."""
    if hasattr(module, "out_features") and hasattr(module, "in_features"):
        return int(module.out_features), int(module.in_features)
    return tuple(module.weight.shape)  # type: ignore[return-value]


def install(decoder: nn.Module, weights: AdapterWeights, state, trainable: bool = False) -> dict[str, nn.Module]:
    """Wrap, in place, the adapted projections of ``decoder`` (fused ``qkv_proj`` / ``gate_up_proj`` when
    the weights were packed, the plain ones otherwise) and its embedding. Returns name -> wrapper.

    Raises:
        ValueError: the decoder's layers or shapes do not match ``weights`` (names the layer and projection).
    """
    n_layers = 1 + max((i for i, _ in weights.layers), default=-1)
    if n_layers != len(decoder.layers):
        raise ValueError(f"mask adapter: {n_layers} layers, the model has {len(decoder.layers)}")
    made = {}
    for i, layer in enumerate(decoder.layers):
        for owner_name in ("self_attn", "mlp"):
            owner = getattr(layer, owner_name)
            for fused, parts in _FUSED.items():
                if hasattr(owner, fused) and any((i, p) in weights.layers for p in parts):
                    made[f"layers.{i}.{owner_name}.{fused}"] = _wrap_fused(owner, fused, parts, i, weights, state,
                                                                          trainable)
            for t in weights.targets:
                if _OWNER[t] != owner_name or any(t in parts and hasattr(owner, f) for f, parts in _FUSED.items()):
                    continue
                a, b = weights.layers[(i, t)]
                base = getattr(owner, t)
                if _shape(base) != (b.shape[0], a.shape[1]):
                    raise ValueError(f"mask adapter: layers.{i}.{t} is {tuple(b.shape[:1]) + tuple(a.shape[1:])}, "
                                     f"the model's {_shape(base)}")
                wrapper = MaskLoRALinear(base, a, b, weights.scale, state, trainable)
                setattr(owner, t, wrapper)
                made[f"layers.{i}.{owner_name}.{t}"] = wrapper
    if weights.mask_embedding is not None:
        decoder.embed_tokens = MaskEmbedding(decoder.embed_tokens, weights.mask_token_id, weights.mask_embedding,
                                             trainable)
    return made


def _wrap_fused(owner: nn.Module, fused: str, parts: tuple[str, ...], i: int, weights: AdapterWeights, state,
                trainable: bool) -> MaskLoRALinear:
    """One :class:`MaskLoRALinear` over a fused projection: ``A`` = the parts' ``A`` stacked ``[k r, in]``, ``B``
    block-diagonal ``[sum out, k r]`` (a part without an adapter contributes zero rows/columns)."""
    base = getattr(owner, fused)
    outs = [getattr(owner, p).out_features for p in parts]
    in_f = _shape(base)[1]
    r = weights.rank
    a = torch.zeros(r * len(parts), in_f)
    b = torch.zeros(sum(outs), r * len(parts))
    row = 0
    for k, (p, o) in enumerate(zip(parts, outs)):
        if (i, p) in weights.layers:
            pa, pb = weights.layers[(i, p)]
            if tuple(pa.shape) != (r, in_f) or tuple(pb.shape) != (o, r):
                raise ValueError(f"mask adapter: layers.{i}.{p} has A {tuple(pa.shape)} B {tuple(pb.shape)}, the "
                                 f"model's projection is ({o}, {in_f})")
            a[k * r:(k + 1) * r] = pa
            b[row:row + o, k * r:(k + 1) * r] = pb
        row += o
    wrapper = MaskLoRALinear(base, a, b, weights.scale, state, trainable)
    setattr(owner, fused, wrapper)  # the ProjectionSlice stand-ins read it by name, so they see the wrapper too
    return wrapper


def attach_mask_adapter(loaded, weights: AdapterWeights) -> MaskAdapter:
    """Make ``weights`` the row variant of ``loaded`` (a :class:`~unmask.engine.model.LoadedModel`, native or
    fp16-packed): wrap its projections and embedding, rebuild the fused decoder forward over the wrappers.

    Raises:
        ValueError: the model has a row variant already (a verifier), its family is not prefix-causal with the
            logit shift, the mask ids differ, or the shapes do not match.
    """
    if loaded.row_variant is not None:
        raise ValueError("mask adapter: this model has a row variant already (a verifier); use one or the other")
    d = loaded.dllm
    if d.attention != "prefix_causal" or not d.logit_shift:
        raise ValueError(f"mask adapter: needs a prefix_causal parent with the logit shift (this one: {d.attention}, "
                         f"logit_shift={d.logit_shift})")
    if weights.mask_token_id != d.mask_token_id:
        raise ValueError(f"mask adapter: trained for mask id {weights.mask_token_id}, the parent's is "
                         f"{d.mask_token_id}")
    state = MaskAdapter(weights)
    decoder = loaded.model.base_model
    install(decoder, weights, state)
    if loaded.decoder_forward is not None:
        from .fused_decoder import FusedDecoder

        loaded.decoder_forward = FusedDecoder(decoder, row_invariant=loaded.decoder_forward.row_invariant)
    loaded.row_variant = state
    loaded.refresh_head()
    return state


def extract(decoder: nn.Module, base: AdapterWeights) -> AdapterWeights:
    """The current tensors of the wrappers :func:`install` put in ``decoder`` (unfused, e.g. in training), as
    :class:`AdapterWeights` with ``base``'s settings."""
    out = AdapterWeights(rank=base.rank, alpha=base.alpha, targets=base.targets, mask_token_id=base.mask_token_id)
    for i, layer in enumerate(decoder.layers):
        for t in base.targets:
            mod = getattr(getattr(layer, _OWNER[t]), t)
            out.layers[(i, t)] = (mod.lora_A.detach().float().cpu().clone(), mod.lora_B.detach().float().cpu().clone())
    emb = decoder.embed_tokens
    if isinstance(emb, MaskEmbedding):
        out.mask_embedding = emb.mask_vector.detach().float().cpu().clone()
    return out
