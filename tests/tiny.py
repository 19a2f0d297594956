"""Tiny random models and tokenizers built on the fly (no network), shared by the tests."""
from __future__ import annotations

import functools

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Diffusion language models unmask tokens in parallel.",
    "One two three four five six seven eight nine ten.",
    "What is the capital of France? Paris is the capital of France.",
    "Grüße aus München — 東京 and 北京 are cities. émigré café naïve",
    "def add(a, b):\n    return a + b\n",
]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 320, mask_token: str | None = None):
    """A byte-level BPE tokenizer (every string encodes; multi-byte characters split across tokens)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    if mask_token:
        tok.add_special_tokens({"mask_token": mask_token})
    return tok


def llama_config(vocab_size: int, **kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    base.update(kw)
    cfg = LlamaConfig(**base)
    cfg._attn_implementation = "sdpa"
    return cfg


def make_llama(vocab_size: int, seed: int = 0, **kw):
    """A tiny random LlamaForCausalLM (sdpa), float32, eval mode. Logits scaled up so that argmax is decisive."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab_size, **kw))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def loaded(attention="prefix_causal", block_size=4, logit_shift=True, seed=0, vocab_size=320, family="a2d",
           block_alignment="generation", fixed_block_size=False, **model_kw):
    """A :class:`LoadedModel` around a tiny Llama with a ``[MASK]`` token appended to the tokenizer."""
    from unmask.engine.config import DllmConfig
    from unmask.engine.model import LoadedModel

    tok = make_tokenizer(vocab_size, mask_token="[MASK]")
    mask_id = tok.convert_tokens_to_ids("[MASK]")
    model = make_llama(len(tok), seed=seed, **model_kw)
    eos = [tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")]
    dllm = DllmConfig(family=family, mask_token_id=mask_id, attention=attention, block_size=block_size,
                      logit_shift=logit_shift, eos_token_ids=eos, pad_token_id=eos[0],
                      block_alignment=block_alignment, fixed_block_size=fixed_block_size)
    return LoadedModel(model=model, tokenizer=tok, dllm=dllm, path="<memory>", device=torch.device("cpu"),
                       dtype=torch.float32, max_context=512)
