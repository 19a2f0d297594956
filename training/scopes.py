"""Trainable scope of A2D fine-tuning: ``full | freeze_ffn | qk_only | lora | qlora`` (docs/design.md#training).

* ``full``: every parameter.
* ``freeze_ffn``: everything except the feed-forward (MLP) blocks - the seed's ``--freeze_ffn`` (FFN stores
  knowledge; the AR -> diffusion change is in attention).
* ``qk_only``: only the query and key projections (the seed's most extreme ablation).
* ``lora``: peft LoRA adapters (``--lora-r --lora-alpha --lora-targets``) on a frozen full-precision base.
* ``qlora``: the same adapters on a bitsandbytes NF4 base (CPU and CUDA).
* ``mask_lora``: the mask-row adapter (:mod:`unmask.training.mask_adapter`): LoRA that only mask rows see, and the
  mask token's input embedding, on a frozen parent; saved adapter-only.

In every scope the mask token's embedding row and its LM-head row stay trainable (the row conversion added):
where the embedding / head matrix is otherwise frozen it is made trainable with a gradient hook that zeroes every
other row, and it goes into a parameter group without weight decay, so the other rows stay bit-identical
(Adam's update of a zero gradient with zero moments is exactly zero).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from unmask.engine.config import DllmConfig
from unmask.engine.model import read_config

SCOPES = ("full", "freeze_ffn", "qk_only", "lora", "qlora", "mask_lora")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FFN_NAMES = (".mlp.", ".feed_forward.", ".ffn.")
QK_NAMES = (".q_proj.", ".k_proj.")


@dataclass
class TrainModel:
    """The module being trained and what is needed to save it as a servable checkpoint.

    Attributes:
        model: the transformers causal LM (a ``peft.PeftModel`` for ``lora``/``qlora``).
        tokenizer, dllm: from the source checkpoint. path: the source checkpoint directory (the full-precision
            base that LoRA is merged into at save time).
        scope: the trainable scope. row_ids: ids whose embedding/head rows are trainable in every scope.
        lora: the LoRA settings (``r``, ``alpha``, ``targets``) or None.
        row_params: names of parameters restricted to ``row_ids`` by gradient hooks.
    """

    model: torch.nn.Module
    tokenizer: object
    dllm: DllmConfig
    path: str
    scope: str
    row_ids: list[int]
    lora: dict | None = None
    row_params: list[str] = field(default_factory=list)

    @property
    def base(self) -> torch.nn.Module:
        """The transformers model (unwrapped from peft)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def trainable_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of every parameter with ``requires_grad`` (peft-prefixed names for LoRA scopes)."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay for matrices, none for biases, norms and the row-restricted embedding/head."""
        decay, no_decay = [], []
        for n, p in self.trainable_named():
            if n in self.row_params or p.ndim < 2 or "norm" in n.lower():
                no_decay.append(p)
            else:
                decay.append(p)
        groups = []
        if decay:
            groups.append({"params": decay, "weight_decay": weight_decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups


def _row_hook(rows: torch.Tensor):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(grad.shape[0], 1, dtype=grad.dtype, device=grad.device)
        keep[rows.to(grad.device)] = 1
        return grad * keep
    return hook


def _restrict_rows(tm: TrainModel) -> None:
    """Make the embedding and LM-head rows of ``tm.row_ids`` trainable where the matrix is frozen."""
    base = tm.base
    rows = torch.tensor(tm.row_ids, dtype=torch.long)
    mats = [base.get_input_embeddings().weight]
    head = base.get_output_embeddings()
    if head is not None and head.weight is not mats[0]:
        mats.append(head.weight)
    names = {id(p): n for n, p in tm.model.named_parameters()}
    for w in mats:
        if w.requires_grad:
            continue
        w.requires_grad_(True)
        w.register_hook(_row_hook(rows))
        tm.row_params.append(names[id(w)])


def load_source(path: str | Path, quantize_nf4: bool = False, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32):
    """Load an a2d checkpoint for training: ``(model, tokenizer, dllm)``, sdpa attention, train mode.

    Raises:
        CheckpointError: not a checkpoint directory, or no ``dllm`` section.
    """
    from transformers import AutoModelForCausalLM

    from unmask.engine.config import CheckpointError
    from unmask.engine.families.common import load_tokenizer

    path = Path(path)
    cfg = read_config(path)
    if not isinstance(cfg.get("dllm"), dict):
        raise CheckpointError(f"{path / 'config.json'}: no `dllm` section (convert the AR model first: "
                              "`unmask convert SRC OUT`)")
    dllm = DllmConfig.from_dict(cfg["dllm"], where=f"{path / 'config.json'}:dllm")
    if isinstance(cfg.get("quantization_config"), dict):
        raise CheckpointError(f"{path}: is quantized; train from the full-precision checkpoint (qlora quantizes "
                              "the base itself)")
    kwargs = {}
    if quantize_nf4:
        from transformers import BitsAndBytesConfig

        compute = dtype if torch.device(device).type == "cuda" else torch.float32
        kwargs = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                            bnb_4bit_compute_dtype=compute),
                  "device_map": {"": str(device)}}
    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", dtype=dtype, **kwargs)
    if not quantize_nf4:
        model.to(device)
    return model, load_tokenizer(path), dllm


def prepare_model(path: str | Path, scope: str = "full", lora_r: int = 16, lora_alpha: float = 32.0,
                  lora_targets: list[str] | tuple[str, ...] | None = None, device: str | torch.device = "cpu",
                  gradient_checkpointing: bool = False) -> TrainModel:
    """Load the checkpoint at ``path`` and set its trainable scope (see the module docstring).

    Raises:
        ValueError: unknown scope, or LoRA targets that match no module (names the field).
    """
    if scope not in SCOPES:
        raise ValueError(f"trainable: {scope!r} is not one of {SCOPES}")
    model, tok, dllm = load_source(path, quantize_nf4=(scope == "qlora"), device=device)
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tm = TrainModel(model=model, tokenizer=tok, dllm=dllm, path=str(path), scope=scope,
                    row_ids=[dllm.mask_token_id])
    if scope == "mask_lora":
        from .mask_adapter import prepare

        prepare(tm, lora_r, lora_alpha, lora_targets)
        tm.model.train()
        return tm
    if scope in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        targets = list(lora_targets or DEFAULT_LORA_TARGETS)
        present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [t for t in targets if t not in present]
        if missing:
            raise ValueError(f"lora-targets: {missing} match no module of this model (have e.g. "
                             f"{sorted(x for x in present if x.endswith('proj'))})")
        tm.lora = {"r": int(lora_r), "alpha": float(lora_alpha), "targets": targets}
        tm.model = get_peft_model(model, _lora_config(tm.lora))
    else:
        for n, p in model.named_parameters():
            key = f".{n}"
            if scope == "full":
                p.requires_grad_(True)
            elif scope == "freeze_ffn":
                p.requires_grad_(not any(f in key for f in FFN_NAMES))
            else:  # qk_only
                p.requires_grad_(any(f in key for f in QK_NAMES))
    _restrict_rows(tm)
    tm.model.train()
    return tm


def _lora_config(lora: dict):
    from peft import LoraConfig

    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(lora["targets"]),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def trainable_state(tm: TrainModel) -> dict[str, torch.Tensor]:
    """The tensors resume needs beyond the servable weights: for LoRA scopes every trainable parameter (adapters,
    embedding and head), for the others nothing (the servable weights are the parameters)."""
    if tm.lora is None and tm.scope != "mask_lora":
        return {}
    return {n: p.detach().to("cpu", torch.float32).clone() for n, p in tm.trainable_named()}


def load_trainable_state(tm: TrainModel, state: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable tensors (from :func:`trainable_state`) into ``tm.model``.

    Raises:
        KeyError: a saved name is not a parameter of the model.
    """
    params = dict(tm.model.named_parameters())
    for n, t in state.items():
        if n not in params:
            raise KeyError(f"trainable state: {n} is not a parameter of this model")
        with torch.no_grad():
            params[n].copy_(t.to(params[n].device, params[n].dtype))


def merged_full_precision(tm: TrainModel) -> torch.nn.Module:
    """A plain full-precision transformers model with the trained weights, ready to save.

    ``full``/``freeze_ffn``/``qk_only``: the model itself. ``lora``/``qlora``: a fresh float32 copy of the source
    base (never the dequantized NF4 weights, docs/design.md#decisions) with the trained adapters merged in and the
    trained embedding/head rows copied.
    """
    if tm.lora is None:
        return tm.base
    from peft import get_peft_model

    base, _, _ = load_source(tm.path, device="cpu", dtype=torch.float32)
    fresh = get_peft_model(base, _lora_config(tm.lora))
    state = trainable_state(tm)
    load_trainable_state(TrainModel(fresh, None, tm.dllm, tm.path, tm.scope, tm.row_ids, tm.lora), state)
    merged = fresh.merge_and_unload()
    merged.eval()
    return merged
