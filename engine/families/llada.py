"""``llada``: LLaDA (GSAI-ML/LLaDA-8B-Base/-Instruct, LLaDA-1.5) checkpoints, loaded without remote code.

LLaDA ships an OLMo-style model (``LLaDAModelLM``, ``model_type: llada``) whose "llama" block is a Llama decoder
layer under other names. We build a transformers :class:`~transformers.LlamaForCausalLM` from its config and
rename the weights (verified against the public ``modeling_llada.py`` / ``configuration_llada.py``, as shipped
with NVlabs/Fast-dLLM ``llada/model/``):

=====================================================  ===========================================
LLaDA (``model.transformer.`` prefix)                   Llama
=====================================================  ===========================================
``wte.weight``                                          ``model.embed_tokens.weight``
``blocks.N.attn_norm.weight``                           ``model.layers.N.input_layernorm.weight``
``blocks.N.q_proj`` / ``k_proj`` / ``v_proj``           ``model.layers.N.self_attn.q_proj`` / ...
``blocks.N.attn_out``                                   ``model.layers.N.self_attn.o_proj``
``blocks.N.ff_norm.weight``                             ``model.layers.N.post_attention_layernorm.weight``
``blocks.N.ff_proj`` (activated) / ``up_proj``          ``model.layers.N.mlp.gate_proj`` / ``up_proj``
``blocks.N.ff_out``                                     ``model.layers.N.mlp.down_proj``
``ln_f.weight``                                         ``model.norm.weight``
``ff_out.weight`` (head; absent when ``weight_tying``)  ``lm_head.weight``
=====================================================  ===========================================

The block computes ``x + attn_out(attn(q, k, v))`` then ``x + ff_out(act(ff_proj(h)) * up_proj(h))`` with RMS
norms (``layer_norm_type: rms``, ``rms_norm_eps``), RoPE with ``rope_theta`` on ``d_model / n_heads`` dims
(``rotate_half`` layout), grouped KV heads (``n_kv_heads``) and no attention mask at all: LLaDA is bidirectional.
Config keys: ``d_model``, ``n_heads``, ``n_kv_heads``, ``n_layers``, ``mlp_hidden_size`` (else ``mlp_ratio *
d_model``), ``embedding_size`` (else ``vocab_size``), ``max_sequence_length``, ``rope_theta``, ``rms_norm_eps``,
``weight_tying``. Options the Llama layout cannot express (ALiBi, sequential/parallel blocks, QK layer norm,
biases, scaled logits, ...) are refused with a :class:`CheckpointError` naming the key.

Decoding settings (ML-GSAI/LLaDA ``generate.py``): bidirectional attention, no logit shift, mask id 126336
(``<|mdm_mask|>``), EOS 126081 (``<|endoftext|>``) and EoT 126348 (``<|eot_id|>``), block length 32, temperature 0.
The ids are read from the checkpoint first (config ``mask_token_id``/``eos_token_id``, then the tokenizer).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import CheckpointError
from . import FamilyAdapter
from .common import build_foreign_model, declares, positive_int, read_state_dict

ARCHITECTURE = "LLaDAModelLM"
MASK_TOKENS = ("<|mdm_mask|>",)
END_TOKENS = ("<|endoftext|>", "<|eot_id|>")
DEFAULT_MASK_ID = 126336
DEFAULT_EOS_IDS = [126081, 126348]
DEFAULT_BLOCK_SIZE = 32  # generate.py main(): block_length=32

_BLOCK_RENAMES = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_TOP_RENAMES = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}
_BLOCK_KEY = re.compile(r"model\.transformer\.blocks\.(\d+)\.([a-z_]+)\.(weight|bias)")

# (key, value LLaDA's modeling code needs for the Llama-equivalent block, what it means)
_REQUIRED = (
    ("block_type", "llama", "only the 'llama' block maps onto Llama (q_proj/k_proj/v_proj, ff_proj/up_proj)"),
    ("layer_norm_type", "rms", "only RMS layer norms map onto Llama"),
    ("rope", True, "LLaDA's masked-diffusion model requires RoPE"),
    ("alibi", False, "ALiBi is not supported"),
    ("attention_layer_norm", False, "QK layer norm has no Llama equivalent"),
    ("input_emb_norm", False, "scaled input embeddings have no Llama equivalent"),
    ("scale_logits", False, "scaled logits have no Llama equivalent"),
    ("include_bias", False, "biases (including the head's) have no Llama equivalent"),
    ("include_qkv_bias", False, "q/k/v-only biases have no Llama equivalent"),
    ("block_group_size", 1, "grouped blocks (block_groups.*) are not supported"),
)
_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "relu": "relu"}


def detect(config: dict) -> bool:
    """``architectures`` contains ``LLaDAModelLM`` or ``model_type == "llada"``."""
    return declares(config, (ARCHITECTURE,), ("llada",))


def llama_config_from_llada(config: dict, path: Path | str = ""):
    """A transformers ``LlamaConfig`` equivalent to a LLaDA ``config.json`` (see the module docstring).

    Raises:
        CheckpointError: a required key is missing or an option has no Llama equivalent (names the key).
    """
    from transformers import LlamaConfig

    where = Path(path) / "config.json"
    for key, value, why in _REQUIRED:
        got = config.get(key, value)
        if key == "include_qkv_bias" and got is None:
            got = False
        if got != value:
            raise CheckpointError(f"{where}:{key}: {got!r} is not supported ({why}; expected {value!r})")
    if config.get("bias_for_layer_norm"):
        raise CheckpointError(f"{where}:bias_for_layer_norm: layer-norm biases have no Llama equivalent")
    if config.get("layer_norm_with_affine") is False:
        raise CheckpointError(f"{where}:layer_norm_with_affine: norms without weights are not supported")
    act = config.get("activation_type", "swiglu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{where}:activation_type: {act!r} is not supported with the llama block "
                              f"(expected one of {sorted(_ACTIVATIONS)})")
    for key in ("d_model", "n_heads", "n_layers"):
        if key not in config:
            raise CheckpointError(f"{where}: missing `{key}` (not a LLaDA config?)")
    d_model = positive_int(config, "d_model", 1, path)
    n_heads = positive_int(config, "n_heads", 1, path)
    n_layers = positive_int(config, "n_layers", 1, path)
    if d_model % n_heads:
        raise CheckpointError(f"{where}:n_heads: d_model {d_model} is not divisible by n_heads {n_heads}")
    n_kv = config.get("n_kv_heads")
    mqa = config.get("multi_query_attention")
    if n_kv is None:
        n_kv = 1 if mqa else n_heads
    if isinstance(n_kv, bool) or not isinstance(n_kv, int) or n_kv < 1 or n_heads % n_kv:
        raise CheckpointError(f"{where}:n_kv_heads: {n_kv!r} must be a positive divisor of n_heads {n_heads}")
    mlp = config.get("mlp_hidden_size") or config.get("mlp_ratio", 4) * d_model
    vocab_rows = config.get("embedding_size") or config.get("vocab_size")
    if not isinstance(vocab_rows, int) or vocab_rows < 1:
        raise CheckpointError(f"{where}: missing `embedding_size`/`vocab_size`")
    cfg = LlamaConfig(
        vocab_size=vocab_rows, hidden_size=d_model, intermediate_size=int(mlp), num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=d_model // n_heads,
        hidden_act=_ACTIVATIONS[act], max_position_embeddings=int(config.get("max_sequence_length") or 4096),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=float(config.get("rope_theta", 10000.0)),
        attention_bias=False, mlp_bias=False, tie_word_embeddings=bool(config.get("weight_tying", False)),
        bos_token_id=None, eos_token_id=config.get("eos_token_id"), pad_token_id=config.get("pad_token_id"),
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def llama_key(name: str) -> str | None:
    """The Llama parameter name of a LLaDA tensor name, or None when the name has no Llama equivalent."""
    if name in _TOP_RENAMES:
        return _TOP_RENAMES[name]
    m = _BLOCK_KEY.fullmatch(name)
    if m and m.group(2) in _BLOCK_RENAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_RENAMES[m.group(2)]}.{m.group(3)}"
    return None


def remap_state_dict(state: dict[str, torch.Tensor], path: Path | str = "") -> dict[str, torch.Tensor]:
    """Rename LLaDA tensors to Llama names (no copies).

    Raises:
        CheckpointError: a tensor name LLaDA's llama block does not have (lists the first few).
    """
    out, unknown = {}, []
    for name, tensor in state.items():
        new = llama_key(name)
        if new is None:
            unknown.append(name)
        else:
            out[new] = tensor
    if unknown:
        unknown.sort()
        raise CheckpointError(f"{path}: tensors that a LLaDA 'llama' block does not have: {unknown[:6]}"
                              f"{' ...' if len(unknown) > 6 else ''}")
    return out


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype, state_dict=None, tokenizer=None):
    """Load a LLaDA checkpoint directory as a ``LlamaForCausalLM`` with the ``llada`` decoding settings;
    ``state_dict`` (LLaDA's names) and ``tokenizer`` given in memory replace the directory's (a GGUF file's,
    :mod:`.gguf_diffusion`).

    Raises:
        CheckpointError: unsupported config option, weights that do not match, missing tokenizer or ids.
    """
    path = Path(path)
    hf_config = llama_config_from_llada(config, path)
    state = remap_state_dict(read_state_dict(path) if state_dict is None else state_dict, path)
    return build_foreign_model(
        path, config, device, dtype, family="llada", arch="LlamaForCausalLM", hf_config=hf_config,
        state_dict=state, mask_tokens=MASK_TOKENS, default_mask=DEFAULT_MASK_ID, end_tokens=END_TOKENS,
        default_eos=DEFAULT_EOS_IDS, attention="bidirectional", block_size=DEFAULT_BLOCK_SIZE, logit_shift=False,
        family_temperature=0.0, tokenizer=tokenizer,
    )


ADAPTER = FamilyAdapter(name="llada", detect=detect, load=load)
