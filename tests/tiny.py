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


# ------------------------------------------------------------------ foreign family replicas (tests/test_families.py,
# tests/test_llada_golden.py): tiny random models saved in each family's own layout (config keys, weight names).

def family_tokenizer(extra_tokens: list[str], vocab_size: int = 320):
    """``make_tokenizer`` plus ``extra_tokens`` added as special tokens (ids ``vocab_size, vocab_size + 1, ...``)."""
    tok = make_tokenizer(vocab_size)
    tok.add_tokens(list(extra_tokens), special_tokens=True)
    return tok


def llada_config_dict(vocab_rows: int, eos_token_id: int, mask_token_id: int | None, d_model: int = 64,
                      n_heads: int = 4, n_kv_heads: int = 2, n_layers: int = 2, mlp_hidden_size: int = 128,
                      **overrides) -> dict:
    """A ``config.json`` with LLaDA-8B's keys (GSAI-ML/LLaDA-8B-Instruct) at tiny sizes."""
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": d_model,
        "embedding_dropout": 0.0, "embedding_size": vocab_rows, "eos_token_id": eos_token_id,
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
        "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "max_sequence_length": 512,
        "mlp_hidden_size": mlp_hidden_size, "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None,
        "n_heads": n_heads, "n_kv_heads": n_kv_heads, "n_layers": n_layers, "pad_token_id": eos_token_id,
        "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
        "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False, "use_cache": False,
        "vocab_size": vocab_rows, "weight_tying": False,
    }
    if mask_token_id is not None:
        cfg["mask_token_id"] = mask_token_id
    cfg.update(overrides)
    return cfg


LLAMA_TO_LLADA_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out", "post_attention_layernorm": "ff_norm",
    "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out",
}


def llama_to_llada_state_dict(state: dict) -> dict:
    """Llama parameter names -> LLaDA's OLMo-style names (``model.transformer.*``), for writing replicas."""
    import re

    out = {}
    for name, t in state.items():
        if name == "model.embed_tokens.weight":
            out["model.transformer.wte.weight"] = t
        elif name == "model.norm.weight":
            out["model.transformer.ln_f.weight"] = t
        elif name == "lm_head.weight":
            out["model.transformer.ff_out.weight"] = t
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
            out[f"model.transformer.blocks.{m.group(1)}.{LLAMA_TO_LLADA_BLOCK[m.group(2)]}.{m.group(3)}"] = t
    return out


def llada_replica_state_dict(config: dict, seed: int, head_scale: float = 8.0, qk_scale: float = 3.0,
                             dead_rows: list[int] = ()) -> dict:
    """Deterministic random weights in LLaDA's layout for ``config`` (LLaDA keys), independent of any library's
    initialisation order: one ``torch.Generator(seed)``; tensors drawn in the order wte, blocks 0..n-1 (attn_norm,
    q_proj, k_proj, v_proj, attn_out, ff_norm, ff_proj, up_proj, ff_out), ln_f, ff_out; linear weights
    ``N(0, 1/fan_in)`` (q_proj and k_proj ``N(0, qk_scale^2/fan_in)``: sharper, position-dependent attention),
    embeddings ``N(0, 1)``, norm weights ``1 + 0.1 N(0, 1)``, head ``N(0, head_scale^2/d)`` (logits of std
    ~head_scale: decisive argmax); head rows in ``dead_rows`` (mask, padding rows) are zero."""
    g = torch.Generator().manual_seed(int(seed))
    d, L = config["d_model"], config["n_layers"]
    hd = d // config["n_heads"]
    kv = config["n_kv_heads"] * hd
    ff = config["mlp_hidden_size"]
    V = config["embedding_size"]

    def lin(out_f, in_f, scale=1.0):
        return torch.randn(out_f, in_f, generator=g) * (scale / in_f ** 0.5)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.transformer.wte.weight": torch.randn(V, d, generator=g)}
    for i in range(L):
        p = f"model.transformer.blocks.{i}."
        sd[p + "attn_norm.weight"] = norm(d)
        sd[p + "q_proj.weight"] = lin(d, d, qk_scale)
        sd[p + "k_proj.weight"] = lin(kv, d, qk_scale)
        sd[p + "v_proj.weight"] = lin(kv, d)
        sd[p + "attn_out.weight"] = lin(d, d)
        sd[p + "ff_norm.weight"] = norm(d)
        sd[p + "ff_proj.weight"] = lin(ff, d)
        sd[p + "up_proj.weight"] = lin(ff, d)
        sd[p + "ff_out.weight"] = lin(d, ff)
    sd["model.transformer.ln_f.weight"] = norm(d)
    head = lin(V, d, head_scale)
    for r in dead_rows:
        head[r] = 0.0
    sd["model.transformer.ff_out.weight"] = head
    return sd


def save_foreign_checkpoint(out, state: dict, config: dict, tokenizer, shards: int = 1,
                            tokenizer_config_updates: dict | None = None, generation_config: dict | None = None):
    """Write a checkpoint directory the way the family publishes it: ``config.json`` (as given), safetensors
    weights (``model.safetensors``, or ``shards`` files + ``model.safetensors.index.json``), the tokenizer files
    (``tokenizer_config.json`` patched with ``tokenizer_config_updates``; a None value deletes the key) and an
    optional ``generation_config.json``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    names = sorted(state)
    if shards <= 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: state[k] for k in names[s * per:(s + 1) * per]}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        total = sum(v.numel() * v.element_size() for v in state.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out))
    if tokenizer_config_updates:
        tc_path = out / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        for k, v in tokenizer_config_updates.items():
            if v is None:
                tc.pop(k, None)
            else:
                tc[k] = v
        tc_path.write_text(json.dumps(tc, indent=2))
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return out


def random_adapter_weights(m, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """Mask-row adapter weights for the tiny :class:`LoadedModel` ``m`` (``unmask.engine.mask_adapter``) that
    change the mask rows: random A, a non-zero B (a fresh adapter is the identity) and a random mask embedding."""
    from unmask.engine.mask_adapter import init_adapter

    w = init_adapter(m.model.base_model, rank, alpha, mask_token_id=m.dllm.mask_token_id,
                     generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    for k, (a, b) in w.layers.items():
        w.layers[k] = (a, 0.5 * torch.randn(b.shape, generator=g))
    w.mask_embedding = torch.randn(w.mask_embedding.shape, generator=g)
    return w


def loaded_with_adapter():
    """A tiny model (``initializer_range=0.5``) with :func:`random_adapter_weights` attached: the mask-adapter
    decoding path."""
    from unmask.engine.mask_adapter import attach_mask_adapter

    m = loaded(initializer_range=0.5)
    attach_mask_adapter(m, random_adapter_weights(m))
    return m


# The four attention layouts the cache tests (chunked prefill, prefix cache) run, by name: each a fresh model.
CACHE_LAYOUTS = {
    "prefix_causal": lambda: loaded(),
    "block_causal_absolute": lambda: loaded(attention="block_causal", block_alignment="absolute",
                                            fixed_block_size=True, logit_shift=False),
    "block_causal_generation": lambda: loaded(attention="block_causal"),
    "mask_adapter": loaded_with_adapter,
}
# (layout, SamplingParams keywords): the decoding paths both cache tests check on those layouts.
CACHE_CASES = [
    ("prefix_causal", dict(block_size=1, temperature=0.0)),
    ("prefix_causal", dict(block_size=4, temperature=0.9, seed=5, top_k=50)),
    ("prefix_causal", dict(block_size=4, speculative=True, temperature=0.0)),
    ("prefix_causal", dict(block_size=4, speculative=True, temperature=0.8, seed=7)),
    ("prefix_causal", dict(block_size=4, temperature=0.0, cfg_scale=1.0)),
    ("prefix_causal", dict(block_size=4, temperature=0.0, multi_block=0.5)),
    ("block_causal_absolute", dict(temperature=0.0)),
    ("block_causal_generation", dict(temperature=0.7, seed=2)),
    ("mask_adapter", dict(block_size=4, temperature=0.0, steps=4)),
    ("mask_adapter", dict(block_size=4, speculative=True, temperature=0.0)),
]


def case_ids(cases) -> list[str]:
    """pytest ids of ``(layout, keywords)`` cases: ``layout-key1value1-key2value2``."""
    return [f"{m}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for m, kw in cases]


def loaded_with_verifier(verifier_seed=0, drafter_seed=1, block_size=4, **model_kw):
    """``(routed, verifier)``: a prefix-causal tiny drafter whose causal rows run ``verifier``'s weights
    (``unmask.engine.routed``), and that verifier as its own :class:`LoadedModel` (two different random models)."""
    verifier = loaded(attention="prefix_causal", block_size=block_size, seed=verifier_seed, **model_kw)
    routed = loaded(attention="prefix_causal", block_size=block_size, seed=drafter_seed, **model_kw)
    routed.attach_verifier(verifier.model)
    routed.dllm.verifier = "<memory>"
    return routed, verifier


def int4_grid(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[out, in]`` moved onto the int4 grid of ``engine.lowbit.quantize_int4`` (groups of 32 input features,
    16 levels from the group's min to its max): what a Q4_1 GGUF's dequantized blocks look like."""
    from unmask.engine.lowbit import INT4_GROUP, quantize_int4

    q, sz = quantize_int4(w)
    n, k = w.shape
    scale, zero = sz[..., 0].T[..., None], sz[..., 1].T[..., None]
    return ((q.reshape(n, -1, INT4_GROUP).float() - 8) * scale + zero).reshape(n, k)


def snap_decoder_to_int4_grid(m):
    """Move every decoder linear layer of loaded model ``m`` onto :func:`int4_grid` in place (the LM head and
    embeddings stay float, like a Q4_1 GGUF's Q8_0 head); returns ``m``."""
    with torch.no_grad():
        for mod in m.model.base_model.modules():
            if type(mod) is torch.nn.Linear:
                mod.weight.copy_(int4_grid(mod.weight))
    return m


def training_dir(d, rows, name: str = "src", data: str = "data.jsonl", **loaded_kw):
    """For a training test: a tiny model's checkpoint at ``d/name`` and ``rows`` as the JSONL file ``d/data``;
    returns the model (:func:`loaded` with ``loaded_kw``)."""
    import json

    from unmask.engine.checkpoint import write_checkpoint

    lm = loaded(**loaded_kw)
    write_checkpoint(d / name, lm.model, lm.tokenizer, lm.dllm)
    (d / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return lm
