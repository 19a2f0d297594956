"""Verifier-routed forwards: one forward in which causal rows run the verifier's weights and mask rows the drafter's.

Self-speculative decoding (``unmask.engine.speculative``) verifies diffusion drafts with the model's own causal
path, so its output is the A2D model's ``block_size=1`` greedy decoding - which training moves away from the AR
parent's. A checkpoint may instead name a *verifier*: a checkpoint of the same architecture and tokenizer (the
untrained conversion of the parent is the intended one). Every linear layer, norm and embedding of the model is
then a :class:`RoutedModule` holding both weight sets; before a forward the denoiser marks the *variant rows* (the
causal context and drafts of speculative requests), which run the verifier's weights; the others, the *drafter rows*
(mask tokens of speculative requests, and every row of ordinary diffusion requests), run the model's own. Attention is shared: a mask row
attends to the verifier's keys/values of the context, and causal rows never attend to mask rows (prefix-causal
mask), so the causal rows compute exactly the verifier's own forward and a speculative request's output is the
verifier's greedy decoding token for token - for the parent's conversion, the AR parent's output - while the
drafter supplies the drafts. This is draft-then-verify speculative decoding (Leviathan et al. 2023) with the
diffusion model as the drafter and both models in one batched forward (per-row weight selection as in multi-LoRA
serving, e.g. Punica/S-LoRA), at the FLOPs of one model's forward.

The seam: :class:`RowRouter` is a :class:`unmask.engine.model.RowVariant` (``select(variant_rows)``), attached with
:func:`route_to_verifier`; :class:`~unmask.engine.model.LoadedModel` knows nothing else of routing
(docs/design.md#extensions-and-seams).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


class RowRouter:
    """Shared routing state of one model: ``drafter_rows`` is a bool tensor whose shape equals the leading
    dimensions of every routed module's input during the current forward (``[B, Q]`` inside the decoder, ``[N]``
    for the LM head), True where the drafter's weights apply; ``None`` = every row uses the drafter."""

    def __init__(self) -> None:
        self._rows: torch.Tensor | None = None
        self.drafter_index = self.verifier_index = None  # flat [n] int64 row indices, computed once per forward

    @property
    def drafter_rows(self) -> torch.Tensor | None:
        """The current row mask (see the class docstring)."""
        return self._rows

    @drafter_rows.setter
    def drafter_rows(self, rows: torch.Tensor | None) -> None:
        self._rows = rows
        if rows is None:
            self.drafter_index = self.verifier_index = None
            return
        flat = rows.reshape(-1)
        self.drafter_index = flat.nonzero().flatten()
        self.verifier_index = (~flat).nonzero().flatten()

    @contextlib.contextmanager
    def select(self, variant_rows: torch.Tensor, host: torch.Tensor | None = None):
        """The :class:`~unmask.engine.model.RowVariant` seam: inside, the ``variant_rows`` (bool) run the verifier's
        weights and the other rows the drafter's (``drafter_rows = ~variant_rows``; ``host`` is not used)."""
        self.drafter_rows = ~variant_rows
        try:
            yield
        finally:
            self.drafter_rows = None


class RoutedModule(nn.Module):
    """One parameterised leaf module (linear, quantized linear, norm, embedding) in both weight sets.

    ``forward(x)`` splits ``x`` by the router's mask over its leading dimensions, runs the drafter's module on the
    drafter rows and the verifier's on the others, and scatters the outputs back (same shape as either module
    alone). Raises ``RuntimeError`` when the mask's shape does not match ``x``'s leading dimensions.
    """

    def __init__(self, drafter: nn.Module, verifier: nn.Module, router: RowRouter):
        super().__init__()
        self.drafter = drafter
        self.verifier = verifier
        self.router = router

    @property
    def weight(self) -> torch.Tensor:
        """The drafter's weight (for code that reads ``module.weight``: dtype, shape, tying)."""
        return self.drafter.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.router.drafter_rows
        if rows is None:
            return self.drafter(x)
        if rows.shape != x.shape[: rows.dim()]:
            raise RuntimeError(f"routed forward: row mask {tuple(rows.shape)} does not match input {tuple(x.shape)}")
        d_idx, v_idx = self.router.drafter_index, self.router.verifier_index
        if not v_idx.numel():
            return self.drafter(x)
        if not d_idx.numel():
            return self.verifier(x)
        flat = x.reshape(rows.numel(), *x.shape[rows.dim():])
        out_d = self.drafter(flat.index_select(0, d_idx))
        out_v = self.verifier(flat.index_select(0, v_idx))
        out = out_d.new_empty(rows.numel(), *out_d.shape[1:])
        out.index_copy_(0, d_idx, out_d)
        out.index_copy_(0, v_idx, out_v.to(out_d.dtype))
        return out.reshape(*rows.shape, *out_d.shape[1:])


#: config keys that shape a forward without being visible in the weight shapes (head split, RoPE, norms, MLP)
ARCHITECTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "layer_norm_eps", "rope_theta",
                     "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias", "mlp_bias",
                     "vocab_size", "tie_word_embeddings", "sliding_window", "use_sliding_window", "layer_types")


def architecture_mismatch(a, b) -> str | None:
    """The first architecture setting (``ARCHITECTURE_KEYS``) in which transformers configs ``a`` and ``b`` differ,
    as ``"key: a_value vs b_value"``, or None when they agree on all of them."""
    da, db = a.to_dict(), b.to_dict()
    for key in ARCHITECTURE_KEYS:
        if da.get(key) != db.get(key):
            return f"{key}: {da.get(key)!r} vs {db.get(key)!r}"
    return None


def _leaf_modules_with_weights(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module for every module that owns parameters directly (not through children)."""
    out = {}
    for name, mod in model.named_modules():
        if name and any(True for _ in mod.parameters(recurse=False)):
            out[name] = mod
    return out


def attach_verifier(drafter: nn.Module, verifier: nn.Module) -> RowRouter:
    """Replace, in place, every weight-owning leaf module of ``drafter`` (a transformers causal LM) by a
    :class:`RoutedModule` pairing it with the same-named module of ``verifier``.

    Tied weights (input embedding = LM head) are routed at both places. Modules are matched by name; the two models
    must have the same architecture (same module names and shapes; quantization may differ).

    Returns:
        the :class:`RowRouter` the denoiser sets before each forward.

    Raises:
        ValueError: the architecture settings differ (``ARCHITECTURE_KEYS``: parameter-free code such as the head
            split and RoPE runs with the model's settings on every row), the module names differ, or a pair's
            weight shapes differ (names the key or module).
    """
    if getattr(drafter, "config", None) is not None and getattr(verifier, "config", None) is not None:
        diff = architecture_mismatch(drafter.config, verifier.config)
        if diff:
            raise ValueError(f"verifier: architecture differs from the model ({diff})")
    router = RowRouter()
    d_mods = _leaf_modules_with_weights(drafter)
    v_mods = _leaf_modules_with_weights(verifier)
    if set(d_mods) != set(v_mods):
        only_d = sorted(set(d_mods) - set(v_mods))[:4]
        only_v = sorted(set(v_mods) - set(d_mods))[:4]
        raise ValueError(f"verifier: architecture differs from the model (only in model: {only_d}; only in "
                         f"verifier: {only_v})")
    for name, d in d_mods.items():
        v = v_mods[name]
        for (pn, dp), (_, vp) in zip(d.named_parameters(recurse=False), v.named_parameters(recurse=False)):
            d_shape = getattr(dp, "quant_state", None) and dp.quant_state.shape or dp.shape
            v_shape = getattr(vp, "quant_state", None) and vp.quant_state.shape or vp.shape
            if tuple(d_shape) != tuple(v_shape):
                raise ValueError(f"verifier: {name}.{pn} has shape {tuple(v_shape)}, the model's {tuple(d_shape)}")
    routed: dict[int, RoutedModule] = {}  # id(drafter module) -> its RoutedModule (tied modules share one)
    for name, d in d_mods.items():
        parent_name, _, attr = name.rpartition(".")
        parent = drafter.get_submodule(parent_name) if parent_name else drafter
        if id(d) not in routed:
            routed[id(d)] = RoutedModule(d, v_mods[name], router)
        setattr(parent, attr, routed[id(d)])
    return router


def route_to_verifier(loaded, verifier_model) -> RowRouter:
    """Make ``verifier_model`` (a transformers causal LM of the same architecture) the row variant of ``loaded``
    (a :class:`~unmask.engine.model.LoadedModel` with native weights): :func:`attach_verifier` on its module, then
    :meth:`~unmask.engine.model.LoadedModel.attach_row_variant`.

    Raises:
        ValueError: the weights are packed already (before anything changes), or :func:`attach_verifier`'s errors.
    """
    if loaded.weight_format != "native":
        raise ValueError("attach the verifier before packing the weights (load_model does both in that order)")
    router = attach_verifier(loaded.model, verifier_model)
    loaded.attach_row_variant(router)
    return router
