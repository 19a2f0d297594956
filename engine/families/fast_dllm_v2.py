"""``fast_dllm_v2``: NVlabs Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, _1.5B) checkpoints, without
remote code.

``Fast_dLLM_QwenForCausalLM`` (``model_type: Fast_dLLM_Qwen``) is Qwen2.5 fine-tuned for block diffusion: the same
parameter names and config keys as Qwen2 plus ``bd_size`` (the training block size, 32), checked against its
``modeling.py`` (``Fast_dLLM_QwenAttention`` q/k/v with bias, ``Fast_dLLM_QwenMLP`` gate/up/down,
``model.embed_tokens``, ``model.norm``, ``lm_head``). The weights load strictly onto
:class:`~transformers.Qwen2ForCausalLM`.

Decoding settings (its ``generate()``): block-causal attention with blocks of ``bd_size`` aligned to position 0
(``eval_block_diff_mask``: ``q // bd >= k // bd``; the prompt's last partial block is completed first:
``block_size - prompt_length % block_size`` masks), so the block size is fixed; ``small_block_size`` 8 is the
per-step decoding window inside a block (``sub_block_size``); token shift (logit shift: the next token is read from
the previous position); mask ``|<MASK>|`` 151665 (from config ``mask_token_id`` or the tokenizer); stop token
``<|im_end|>`` 151645 (plus ``<|endoftext|>``); temperature 0.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import FamilyAdapter
from .common import build_foreign_model, declares, positive_int, qwen_style_config, read_state_dict

ARCHITECTURE = "Fast_dLLM_QwenForCausalLM"
MASK_TOKENS = ("|<MASK>|",)
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
DEFAULT_MASK_ID = 151665
DEFAULT_EOS_IDS = [151645, 151643]
DEFAULT_BLOCK_SIZE = 32  # bd_size of the released checkpoints
SUB_BLOCK_SIZE = 8  # generate(small_block_size=8)


def detect(config: dict) -> bool:
    """``architectures`` contains ``Fast_dLLM_QwenForCausalLM`` or ``model_type`` is ``Fast_dLLM_Qwen``."""
    return declares(config, (ARCHITECTURE,), ("fast_dllm_qwen",))


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype):
    """Load a Fast-dLLM v2 checkpoint directory as a ``Qwen2ForCausalLM`` with block-causal decoding settings.

    Raises:
        CheckpointError: bad ``bd_size``, weights that do not match Qwen2, missing tokenizer or ids.
    """
    from transformers import Qwen2Config

    path = Path(path)
    block = positive_int(config, "bd_size", DEFAULT_BLOCK_SIZE, path)
    hf_config = qwen_style_config(Qwen2Config, config)
    return build_foreign_model(
        path, config, device, dtype, family="fast_dllm_v2", arch="Qwen2ForCausalLM", hf_config=hf_config,
        state_dict=read_state_dict(path), mask_tokens=MASK_TOKENS, default_mask=DEFAULT_MASK_ID,
        end_tokens=END_TOKENS, default_eos=DEFAULT_EOS_IDS, attention="block_causal", block_size=block,
        logit_shift=True, block_alignment="absolute", fixed_block_size=True,
        sub_block_size=min(SUB_BLOCK_SIZE, block), family_temperature=0.0,
        tokenizer_fallbacks=("Qwen2Tokenizer", "Qwen2TokenizerFast"),
    )


ADAPTER = FamilyAdapter(name="fast_dllm_v2", detect=detect, load=load)
