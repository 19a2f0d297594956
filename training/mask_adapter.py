"""Training the mask-row adapter (``--trainable mask_lora``; docs/design.md#training and #mask-row-adapter).

The parent checkpoint is frozen; the only trainable tensors are the adapter's LoRA matrices (the engine's own
:class:`unmask.engine.mask_adapter.MaskLoRALinear`, so what is trained is exactly what decodes) and the mask
token's input embedding (:class:`~unmask.engine.mask_adapter.MaskEmbedding`). The adapter runs only on variant
rows, as in the engine:

* ``block``: the noisy copies of the answer blocks are the variant rows; the clean copy (committed context) runs
  the parent. A row of the block layout is a noisy copy exactly when its position differs from its column (the
  clean copy sits at columns ``0..n-1`` with positions ``0..n-1``; noisy copies repeat earlier positions).
* ``draft``: the parent forwards the clean context causally (no adapter, no gradient; it is the verifier) and the
  draft groups - all mask rows - run with the adapter against the parent's keys/values.

The loss is therefore restricted to mask rows: every scored output is a variant row's, except the first position
of a block, whose logits come from the committed token before it (the parent's; constant, no gradient). Saved
checkpoints are adapter-only (:mod:`unmask.engine.adapter_files`) naming the parent by its content hash.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch

from unmask.engine.adapter_files import parent_hash, write_adapter
from unmask.engine.mask_adapter import DEFAULT_TARGETS, MaskAdapter, extract, init_adapter, install

from .forwards import context_cache, decoder_out, scored_logits

SCOPE = "mask_lora"


class _TrainState(MaskAdapter):
    """The adapter's row state during training (same protocol as the engine's)."""


def prepare(tm, rank: int, alpha: float, targets, seed: int = 0) -> None:
    """Freeze ``tm.base`` (a :class:`~unmask.training.scopes.TrainModel` just loaded) and install a fresh adapter
    with trainable ``lora_A``/``lora_B`` and mask embedding; sets ``tm.adapter_template``, ``tm.adapter_state``,
    ``tm.parent_sha256``.

    Raises:
        ValueError: bad rank/targets (names the field) or a parent that is not prefix-causal with the logit shift.
    """
    d = tm.dllm
    if d.attention != "prefix_causal" or not d.logit_shift:
        raise ValueError(f"trainable mask_lora: needs a prefix_causal parent with the logit shift (this one: "
                         f"{d.attention}, logit_shift={d.logit_shift})")
    base = tm.base
    for p in base.parameters():
        p.requires_grad_(False)
    decoder = base.get_decoder()
    template = init_adapter(decoder, rank, alpha, tuple(targets or DEFAULT_TARGETS), d.mask_token_id,
                            generator=torch.Generator().manual_seed(seed))
    state = _TrainState(template)
    install(decoder, template, state, trainable=True)
    tm.adapter_template, tm.adapter_state = template, state
    tm.parent_sha256 = parent_hash(tm.path)


def initialise_from(tm, path: str | Path) -> dict:
    """Copy the adapter of the adapter-only checkpoint ``path`` (e.g. another run's ``checkpoint-N``) into the
    adapter :func:`prepare` installed in ``tm`` - a run that *continues* an adapter with another objective (the
    recipe's draft stage after its block stage), with a fresh optimizer. Returns the checkpoint's config dict.

    Raises:
        CheckpointError: ``path`` is not a readable adapter checkpoint.
        ValueError: its rank, alpha, targets or mask id differ from this run's (``--lora-r`` / ``--lora-alpha`` /
            ``--lora-targets``), its layer count from the parent's, or it was trained on another parent (content
            hash; docs/design.md#mask-row-adapter).
    """
    from unmask.engine.adapter_files import read_adapter
    from unmask.engine.mask_adapter import _OWNER

    weights, cfg = read_adapter(path)
    mine = tm.adapter_template
    got = (weights.rank, weights.alpha, tuple(weights.targets), weights.mask_token_id)
    want = (mine.rank, mine.alpha, tuple(mine.targets), mine.mask_token_id)
    if got != want:
        raise ValueError(f"init adapter {path}: rank/alpha/targets/mask id {got} differ from this run's {want} "
                         f"(--lora-r/--lora-alpha/--lora-targets)")
    if cfg["parent"].get("sha256") != tm.parent_sha256:
        raise ValueError(f"init adapter {path}: trained on the parent {cfg['parent'].get('sha256')}, this run's "
                         f"--model {tm.path} is {tm.parent_sha256}")
    decoder = tm.base.get_decoder()
    if set(weights.layers) != set(mine.layers):
        raise ValueError(f"init adapter {path}: adapts {len(weights.layers)} projections, this model "
                         f"{len(mine.layers)}")
    with torch.no_grad():
        for i, layer in enumerate(decoder.layers):
            for t in mine.targets:
                mod = getattr(getattr(layer, _OWNER[t]), t)
                a, b = weights.layers[(i, t)]
                if mod.lora_A.shape != a.shape or mod.lora_B.shape != b.shape:
                    raise ValueError(f"init adapter {path}: layers.{i}.{t} has shapes {tuple(a.shape)}/"
                                     f"{tuple(b.shape)}, the model's {tuple(mod.lora_A.shape)}/"
                                     f"{tuple(mod.lora_B.shape)}")
                mod.lora_A.copy_(a)
                mod.lora_B.copy_(b)
        if weights.mask_embedding is not None:
            decoder.embed_tokens.mask_vector.copy_(weights.mask_embedding)
    return cfg


def variant_rows_of_block_layout(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the noisy-copy rows of a ``block`` layout (position != column; see the module doc)."""
    cols = torch.arange(position_ids.shape[1], device=position_ids.device)
    return position_ids != cols


class MaskBlockForward(torch.nn.Module):
    """The ``block`` / ``mdlm``-style module: ``forward(input_ids, position_ids, attention_mask, src_row, src_col)
    -> [N, V]`` float32, with the adapter on the noisy-copy rows only."""

    def __init__(self, tm):
        super().__init__()
        self.lm = tm.model
        self._tm = [tm]

    def forward(self, input_ids, position_ids, attention_mask, src_row, src_col):
        tm = self._tm[0]
        with tm.adapter_state.select(variant_rows_of_block_layout(position_ids)):
            out = decoder_out(tm.base, input_ids, position_ids, attention_mask)
        return scored_logits(tm.base, out, src_row, src_col)


class MaskDraftForward(torch.nn.Module):
    """The ``draft`` module: the parent (adapter off) forwards the context causally without gradient, the draft
    rows (all mask rows) run with the adapter against its keys/values. Signature as
    :class:`unmask.training.forwards.DraftForward`."""

    def __init__(self, tm):
        super().__init__()
        self.lm = tm.model
        self._tm = [tm]

    def forward(self, context_ids, context_mask, input_ids, position_ids, attention_mask, src_row, src_col):
        tm = self._tm[0]
        cache = context_cache(tm.base, context_ids, context_mask)  # the parent, adapter off: the verifier
        with tm.adapter_state.select(torch.ones_like(input_ids, dtype=torch.bool)):
            out = decoder_out(tm.base, input_ids, position_ids, attention_mask, cache)
        return scored_logits(tm.base, out, src_row, src_col)


def save(path: Path, tm, block_size: int, objective: str, training_state: bytes | None = None,
         training: dict | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write an adapter-only checkpoint into ``path`` (its ``dllm`` overrides: ``block_size`` and
    ``default_sampling.speculative`` true with temperature 0, so greedy requests get the parent's answers by
    default) plus ``training_state.pt`` when given and ``extra_files`` (name -> bytes, e.g. the VFM trial's noise
    adapter, :func:`unmask.training.experimental.vfm.adapter_files`).

    Raises:
        ValueError: non-finite adapter tensors (names one).
    """
    weights = extract(tm.base.get_decoder(), tm.adapter_template)
    for k, t in weights.state_dict().items():
        if not torch.isfinite(t).all():
            raise ValueError(f"mask adapter: non-finite values in {k}; not saving (lower --lr)")
    parent = {"sha256": tm.parent_sha256, "name": str(Path(tm.path).expanduser().resolve())}
    dllm = {"block_size": int(block_size), "default_sampling": {"speculative": True, "temperature": 0.0}}
    tmp = path.parent / f"{path.name}.tmp-adapter"
    write_adapter(tmp, weights, parent, dllm=dllm, training={"objective": objective, **(training or {})})
    if training_state is not None:
        (tmp / "training_state.pt").write_bytes(training_state)
    for name, data in (extra_files or {}).items():
        (tmp / name).write_bytes(data)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def state_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def export_adapter(src: str | Path, out: str | Path, parent: str | Path, dtype: torch.dtype = torch.float16,
                   parent_info: dict | None = None) -> Path:
    """Write the adapter of training checkpoint ``src`` into ``out`` as an adapter-only checkpoint (no training
    state; tensors in ``dtype``, fp16 by default: half the bytes, the delta's precision is far above its error),
    with ``parent.name`` = ``parent``'s absolute path and ``parent_info`` added to the ``parent`` record (e.g. a
    GGUF parent's ``converted_from`` / ``gguf_sha256``; ``sha256`` and ``name`` cannot be replaced). Returns
    ``out``.

    Raises:
        CheckpointError: ``src`` is not an adapter checkpoint.
    """
    from unmask.engine.adapter_files import read_adapter

    weights, cfg = read_adapter(src)
    record = {**cfg["parent"], **(parent_info or {}), "sha256": cfg["parent"]["sha256"],
              "name": str(Path(parent).expanduser().resolve())}
    return write_adapter(out, weights, record, dllm=cfg.get("dllm"), training=cfg.get("training"), dtype=dtype)
