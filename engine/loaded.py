"""A loaded diffusion model (:class:`LoadedModel`: the transformers module, its tokenizer and its
:class:`~unmask.engine.config.DllmConfig`), the row-variant seam (:class:`RowVariant`) and :func:`read_config`.

What the family adapters (``unmask.engine.families``) build and ``unmask.engine.model.load_model`` returns; its own
module so that the adapters import it without importing the loader that dispatches to them (no import cycle,
docs/design.md#layout-and-layers).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

import torch

from .lane_attention import lanes
from .config import CheckpointError, DllmConfig, read_json_file

__all__ = ["LoadedModel", "RowVariant", "read_config"]


class RowVariant(Protocol):
    """The row-variant seam: other weights for some rows of one batched forward (per-row weight selection).

    The denoiser marks, per forward, which rows run the variant (``variant_rows``: ``[B, Q]`` bool inside the
    decoder, ``[N]`` bool for the LM head; True = the variant); :class:`LoadedModel` enters
    ``select(variant_rows)`` around the decoder forward and the LM head, and the variant's modules (installed in
    the transformers module when it was attached) split their input rows by it. Every other row runs the model's
    own weights; ``None`` (or no True row) is the plain forward. Attention is shared, so the rule of which rows may
    see which (``unmask.engine.attention``) is unchanged.

    Implementations:

    * :class:`unmask.engine.routed.RowRouter` (today): a *verifier* checkpoint's weights on the causal rows of
      speculative requests (``dllm.verifier``; docs/design.md#extensions-and-seams).
    * :class:`unmask.engine.mask_adapter.MaskAdapter`: a LoRA delta on the mask (non-committed) rows, ``y = W x +
      scale * B A x`` on the variant rows only (docs/design.md#mask-row-adapter). Its ``rows = "uncommitted"`` makes the
      denoiser mark every valid non-committed row, whatever the strategy; it is attached after weight packing by
      :func:`unmask.engine.adapter_files.apply_adapter`.
    """

    def select(self, variant_rows: torch.Tensor, host: torch.Tensor | None = None) -> ContextManager[None]:
        """Context in which the variant's modules run ``variant_rows`` (bool, the leading dimensions of every
        variant module's input during the forward) with the variant's weights; ``host``: the same rows on the CPU
        when the caller has them (row indices are then taken there, with no device read)."""
        ...


@dataclass
class LoadedModel:
    """A model ready for the denoiser: the core every request uses, plus optional capabilities, each behind one
    seam (the main path reads the same without them).

    Attributes:
        model: a transformers causal-LM module (``.base_model`` -> decoder stack, output embeddings -> LM head),
            loaded with ``attn_implementation="sdpa"`` so that boolean 4-D masks take effect (``load_model`` then
            switches it to :mod:`unmask.engine.lane_attention`'s SDPA per lane, the same masks).
        tokenizer: its tokenizer (chat template included when the checkpoint has one).
        dllm: the diffusion settings.
        path: where it was loaded from.
        device, dtype: where the weights live.
        max_context: the longest canvas (prompt + generation + suffix) the model accepts, in tokens.
        row_variant: a :class:`RowVariant` (per-row weight selection) or None; attached with
            :meth:`attach_row_variant`.
        weight_format: how the linear layers run: ``native`` (as loaded), ``fp16`` (fbgemm-packed), ``int8`` or
            ``int4`` (weight-only low-bit kernels); set by :func:`unmask.engine.packed_weights.pack_model`, the
            packing seam. packed_layers: ``{format: layers}`` it packed (``auto`` on a 4-bit GGUF's weights:
            int4 layers plus the fp16 LM head).
        decoder_forward: a replacement forward of the decoder stack, ``(input_ids, position_ids, attention_mask,
            cache) -> [B, Q, H]`` with the transformers forward's meaning (the fused-decoder seam:
            :class:`~unmask.engine.fused_decoder.FusedDecoder`, installed by ``pack_model``), or None for the
            transformers forward.
        adapter: what :mod:`unmask.engine.adapter_files` attached (path, rank, alpha, targets, parameters, parent
            hash) when a mask-row adapter is the row variant, else None.
        lane_attention: the transformers forward attends over each lane's own cached keys
            (:mod:`unmask.engine.lane_attention`; set by ``load_model``), so the engine's caches run in lane mode.
    """

    model: Any
    tokenizer: Any
    dllm: DllmConfig
    path: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    row_variant: RowVariant | None = None
    weight_format: str = "native"
    packed_layers: dict = field(default_factory=dict)
    decoder_forward: Callable[..., torch.Tensor] | None = None
    adapter: dict | None = None
    lane_attention: bool = False

    def __post_init__(self) -> None:
        self.model.eval()
        self._decoder = self.model.base_model
        self._head = self.model.get_output_embeddings()
        self._vocab_size = int(self._head.weight.shape[0])
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.compiled = False

    @classmethod
    def from_module(cls, model, tokenizer, dllm: DllmConfig, max_context: int | None = None,
                    path: str = "<memory>") -> "LoadedModel":
        """A model built in memory (a replica with random weights, a benchmark's model built on its device):
        ``device`` and ``dtype`` are read from its parameters, ``max_context`` from
        ``config.max_position_embeddings`` unless given. Serve it with ``LLM(LoadedModel.from_module(...))``; build
        the module with ``attn_implementation="sdpa"`` (or eager) so that the engine's boolean 4-D masks apply.

        Raises:
            ValueError: the module has no parameters, or they are on several devices or of several dtypes.
        """
        params = list(model.parameters())
        devices = {p.device for p in params}
        dtypes = {p.dtype for p in params}
        if len(devices) != 1 or len(dtypes) != 1:
            raise ValueError(f"model: expected its parameters on one device in one dtype, got devices "
                             f"{sorted(map(str, devices))} and dtypes {sorted(map(str, dtypes))}")
        if max_context is None:
            max_context = int(model.config.max_position_embeddings)
        return cls(model=model, tokenizer=tokenizer, dllm=dllm, path=path, device=devices.pop(),
                   dtype=dtypes.pop(), max_context=max_context)

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (logits width)."""
        return self._vocab_size

    @property
    def has_row_variant(self) -> bool:
        """Whether forwards may route rows to a :class:`RowVariant` (``variant_rows`` then matters)."""
        return self.row_variant is not None

    @property
    def router(self) -> RowVariant | None:
        """Compatibility alias of :attr:`row_variant` (tests read ``model.router``)."""
        return self.row_variant

    @property
    def decoder_path(self) -> str:
        """Which forward runs the decoder: ``fused`` (:attr:`decoder_forward` set), ``compiled``
        (:meth:`enable_compile`) or ``transformers`` (the model's own forward)."""
        if self.decoder_forward is not None:
            return "fused"
        return "compiled" if self.compiled else "transformers"

    def attach_row_variant(self, variant: RowVariant) -> None:
        """Use ``variant`` for the rows marked in ``variant_rows`` (its modules are already in :attr:`model`).

        Raises:
            ValueError: a variant is attached already, or the weights are packed (attach before packing).
        """
        if self.row_variant is not None:
            raise ValueError("row variant: this model has one already")
        if self.weight_format != "native":
            raise ValueError("attach the verifier before packing the weights (load_model does both in that order)")
        self.row_variant = variant
        self.refresh_head()

    def refresh_head(self) -> None:
        """Re-read the LM head from :attr:`model` after a seam replaced modules in it (routing, packing)."""
        self._head = self.model.get_output_embeddings()

    def attach_verifier(self, verifier_model) -> None:
        """Compatibility alias of :func:`unmask.engine.routed.route_to_verifier` (``tests/tiny.py`` calls it)."""
        from .routed import route_to_verifier

        route_to_verifier(self, verifier_model)

    def enable_compile(self) -> None:
        """Run the transformers decoder forward through ``torch.compile(dynamic=True)`` from now on (same results;
        the first forwards of each new shape pay the compilation). Off by default: it did not pay on the CPU
        measured (docs/design.md#measuring). Idempotent.

        Raises:
            ValueError: (names ``compile``) the weights are packed: torch.compile does not trace fbgemm's kernels.
        """
        if self.weight_format != "native":
            raise ValueError(f"compile: torch.compile does not trace fbgemm-packed ({self.weight_format}) linear "
                             f"layers; load with weights='native' to compile")
        if not self.compiled:
            self._decoder = torch.compile(self.model.base_model, dynamic=True)
            self.compiled = True

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      cache=None, variant_rows: torch.Tensor | None = None, *,
                      drafter_rows: torch.Tensor | None = None,
                      prompt_rows: torch.Tensor | None = None, variant_host: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Last hidden states ``[B, Q, H]`` (the model's dtype) for ``input_ids``/``position_ids`` ``[B, Q]`` int64
        and a boolean mask ``[B, 1, Q, C + Q]`` (True = may attend; C = cached keys in ``cache``, a
        :class:`~unmask.engine.kv_cache.BatchKV`; None = causal, as transformers).

        ``variant_rows``: ``[B, Q]`` bool, the rows that run the :class:`RowVariant` (ignored without one); None =
        every row runs the model's weights. ``drafter_rows`` is the old spelling, its complement (compatibility).
        ``prompt_rows``: ``[B, Q]`` bool, the committed prompt rows, which a row-invariant decoder computes in
        prompt tiles (:attr:`tiles_prompt_rows`; ignored otherwise).

        Raises:
            RuntimeError: ``variant_rows``' shape is not ``[B, Q]`` (a routed module names both shapes).
        """
        with self._select(variant_rows, drafter_rows, variant_host), (lanes(cache) if getattr(cache, "lane_mode", False)
                                                         else contextlib.nullcontext()):
            if self.decoder_forward is not None:
                if prompt_rows is not None and self.tiles_prompt_rows:
                    return self.decoder_forward(input_ids, position_ids, attention_mask, cache,
                                                prompt_rows=prompt_rows)
                return self.decoder_forward(input_ids, position_ids, attention_mask, cache)
            out = self._decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                use_cache=False, **{self._cache_kw: cache})
        return out.last_hidden_state

    @property
    def tiles_prompt_rows(self) -> bool:
        """Whether the decoder computes committed prompt rows in row-invariant prompt tiles
        (``engine/row_attention.py``): their KV then differs in the last bits from block-1 steps' at the same
        position, so the prefix cache keeps prompt rows only (docs/design.md#prefix-reuse)."""
        fused = self.decoder_forward
        return bool(getattr(fused, "row_invariant", False) and getattr(fused, "prompt_tiles", False))

    def logits(self, hidden: torch.Tensor, variant_rows: torch.Tensor | None = None, *,
               drafter_rows: torch.Tensor | None = None, variant_host: torch.Tensor | None = None) -> torch.Tensor:
        """LM head on ``[N, H]`` hidden states -> ``[N, V]`` float32 logits (``variant_rows``: ``[N]`` bool, as in
        :meth:`hidden_states`)."""
        with self._select(variant_rows, drafter_rows, variant_host):
            return self._head(hidden).float()

    def _select(self, variant_rows: torch.Tensor | None, drafter_rows: torch.Tensor | None,
                variant_host: torch.Tensor | None = None):
        if drafter_rows is not None:
            variant_rows = ~drafter_rows
        if self.row_variant is None or variant_rows is None:
            return contextlib.nullcontext()
        if variant_host is not None and _takes_host(self.row_variant):
            return self.row_variant.select(variant_rows, host=variant_host)  # (a variant may not take it)
        return self.row_variant.select(variant_rows)


@functools.lru_cache(maxsize=None)
def _takes_host_of(cls: type) -> bool:
    return "host" in inspect.signature(cls.select).parameters


def _takes_host(variant) -> bool:
    """Whether ``variant.select`` takes the rows' host copy (``host=``); read once per class, not per forward."""
    return _takes_host_of(type(variant))


def read_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint directory as a dict.

    Raises:
        CheckpointError: the directory or file is missing, or the JSON is invalid (with line and column) or not an
            object.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a checkpoint directory with config.json)")
    cfg_file = path / "config.json"
    config = read_json_file(cfg_file)
    if config is None:
        raise CheckpointError(f"{cfg_file}: missing (expected a Hugging Face checkpoint directory)")
    return config
