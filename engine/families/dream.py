"""``dream``: Dream-v0 (Dream-org/Dream-v0-Base-7B, -Instruct-7B) checkpoints, loaded without remote code.

Dream's ``DreamModel`` (``model_type: Dream``) is Qwen2.5 with bidirectional attention: the same parameter names
(``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj`` with q/k/v biases, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``) and config keys
(``hidden_size``, ``num_key_value_heads``, ``rope_theta``, ...), checked against ``modeling_dream.py`` /
``configuration_dream.py`` (Dream-org; copies in NVlabs/Fast-dLLM ``dream/model/``). The weights load strictly
onto :class:`~transformers.Qwen2ForCausalLM`; the attention is set by the masks the engine passes.

Decoding settings (Dream ``generation_utils.py``): bidirectional, logit shift (``logits = cat([logits[:, :1],
logits[:, :-1]])``: position j is predicted at output j-1), mask id 151666 (``<|mask|>``; ``mask_token_id`` in
config.json / generation_config.json), EOS ``<|endoftext|>`` 151643 and ``<|im_end|>`` 151645, temperature 0
(``DreamGenerationConfig``). Dream's sampler decodes the whole generation as one block; the default block size
here is 32 and a request may set ``block_size = max_tokens`` for Dream's own schedule. Dream's tokenizer is a
remote-code ``DreamTokenizer`` (a Qwen2 BPE); we load its files with ``Qwen2Tokenizer``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import FamilyAdapter
from .common import build_foreign_model, declares, qwen_style_config, read_state_dict

ARCHITECTURE = "DreamModel"
MASK_TOKENS = ("<|mask|>",)
END_TOKENS = ("<|endoftext|>", "<|im_end|>")
DEFAULT_MASK_ID = 151666
DEFAULT_EOS_IDS = [151643, 151645]
DEFAULT_BLOCK_SIZE = 32


def detect(config: dict) -> bool:
    """``architectures`` contains ``DreamModel`` or ``model_type`` is ``Dream`` (any case)."""
    return declares(config, (ARCHITECTURE,), ("dream",))


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype, state_dict=None, tokenizer=None):
    """Load a Dream checkpoint directory as a ``Qwen2ForCausalLM`` with the ``dream`` decoding settings;
    ``state_dict`` and ``tokenizer`` given in memory replace the directory's (a GGUF file's, :mod:`.gguf_diffusion`).

    Raises:
        CheckpointError: weights that do not match Qwen2, missing tokenizer or ids.
    """
    from transformers import Qwen2Config

    path = Path(path)
    hf_config = qwen_style_config(Qwen2Config, config)
    return build_foreign_model(
        path, config, device, dtype, family="dream", arch="Qwen2ForCausalLM", hf_config=hf_config,
        state_dict=read_state_dict(path) if state_dict is None else state_dict, mask_tokens=MASK_TOKENS, default_mask=DEFAULT_MASK_ID,
        end_tokens=END_TOKENS, default_eos=DEFAULT_EOS_IDS, attention="bidirectional",
        block_size=DEFAULT_BLOCK_SIZE, logit_shift=True, family_temperature=0.0,
        tokenizer_fallbacks=("Qwen2Tokenizer", "Qwen2TokenizerFast"), tokenizer=tokenizer,
    )


ADAPTER = FamilyAdapter(name="dream", detect=detect, load=load)
