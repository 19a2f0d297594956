"""Tiny random LLaDA2 (MoE block diffusion) replicas built in unmask's own model code, and the adapter that lets
diffusers' ``LLaDA2Pipeline`` call one (the pipeline accepts any model returning logits)."""
from __future__ import annotations

import torch

from tiny import family_tokenizer

MASK = "<|mask|>"


def llada2_config_dict(vocab_size: int, mask_id: int, eos_id: int, **overrides) -> dict:
    """A ``config.json`` with LLaDA2.0-mini's keys (inclusionAI/LLaDA2.0-mini) at tiny sizes: one dense layer then
    MoE layers with group-limited sigmoid routing, a shared expert, partial rotary and q/k norms."""
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 4, "topk_group": 2, "score_function": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5, "rope_theta": 600000.0, "rms_norm_eps": 1e-6,
        "use_qkv_bias": False, "use_bias": False, "use_qk_norm": True, "tie_word_embeddings": False,
        "max_position_embeddings": 512, "hidden_act": "silu", "norm_head": False, "output_router_logits": False,
        "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "rope_scaling": None,
        "pad_token_id": eos_id, "eos_token_id": eos_id, "mask_token_id": mask_id, "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def random_llada2(cfg_dict: dict, seed: int = 0, head_scale: float = 6.0, dead_rows=()):
    """A :class:`Llada2ForDiffusion` of ``cfg_dict`` with deterministic random weights (one generator, parameters
    in ``state_dict`` order; linear ``N(0, 1/fan_in)``, norms ``1 + 0.1 N``, router biases ``0.1 N``, head scaled
    so that argmax is decisive; ``dead_rows`` of the head zero)."""
    from unmask.engine.families.llada2 import llada2_config
    from unmask.engine.llada2_model import Llada2ForDiffusion

    cfg = llada2_config(cfg_dict)
    model = Llada2ForDiffusion(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("expert_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("word_embeddings.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(head_scale)
        for r in dead_rows:
            model.lm_head.weight[r] = 0.0
    return model.eval()


def tokenizer_and_ids():
    tok = family_tokenizer([MASK, "<|role_end|>"])
    return tok, tok.convert_tokens_to_ids(MASK), tok.convert_tokens_to_ids("<|endoftext|>")


def loaded_llada2(seed: int = 0, block_size: int = 8, **overrides):
    """A :class:`LoadedModel` (family ``llada2``, block-causal, absolute blocks) around a tiny random LLaDA2."""
    from unmask.engine.families.llada2 import DEFAULT_THRESHOLD
    from unmask.engine.config import DllmConfig
    from unmask.engine.loaded import LoadedModel

    tok, mask_id, eos_id = tokenizer_and_ids()
    model = random_llada2(llada2_config_dict(len(tok), mask_id, eos_id, **overrides), seed)
    dllm = DllmConfig(family="llada2", mask_token_id=mask_id, attention="block_causal", block_size=block_size,
                      logit_shift=False, eos_token_ids=[eos_id], pad_token_id=eos_id, block_alignment="absolute",
                      default_sampling={"temperature": 0.0, "threshold": DEFAULT_THRESHOLD})
    return LoadedModel(model=model, tokenizer=tok, dllm=dllm, path="<memory>", device=torch.device("cpu"),
                       dtype=torch.float32, max_context=512)


class PipelineModel(torch.nn.Module):
    """What ``LLaDA2Pipeline`` calls: ``(input_ids, attention_mask=[B, L] 0/1, position_ids)`` -> ``.logits``.
    Builds the block-causal mask of the model's training (blocks of ``block_size`` from position 0, keys the 0/1
    mask drops invisible) and sets the ids the engine never generates (``dllm.never_generate_ids``: mask, padding)
    to -inf, as the engine's sampler does."""

    def __init__(self, loaded, block_size: int):
        super().__init__()
        self.inner, self.block_size = loaded.model, block_size
        self.never = torch.tensor(loaded.dllm.never_generate_ids, dtype=torch.long)

    @property
    def device(self) -> torch.device:  # what a diffusers pipeline reads of its modules
        return next(self.inner.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.inner.parameters()).dtype

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        L = input_ids.shape[1]
        blk = torch.arange(L) // self.block_size
        mask = (blk[:, None] >= blk[None, :])[None, None].expand(input_ids.shape[0], 1, L, L).clone()
        if attention_mask is not None:
            mask &= attention_mask.bool()[:, None, None, :]
        out = self.inner(input_ids, attention_mask=mask, position_ids=position_ids)
        out.logits[..., self.never] = float("-inf")
        return out


def run_pipeline(loaded, prompts: list[list[int]], gen_length: int, block_size: int, steps: int, threshold: float,
                 editing_threshold: float | None, max_post_steps: int = 16) -> list[list[int]]:
    """diffusers' LLaDA2Pipeline + BlockRefinementScheduler, greedy, on ``prompts`` (equal lengths) as one batch:
    per prompt the generated ids up to and including the first EOS (the pipeline's own trim of its output)."""
    from diffusers import BlockRefinementScheduler, LLaDA2Pipeline

    pipe = LLaDA2Pipeline(model=PipelineModel(loaded, block_size), scheduler=BlockRefinementScheduler(),
                          tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    eos = loaded.dllm.eos_token_ids[0]
    out = pipe(input_ids=torch.tensor(prompts), gen_length=gen_length, block_length=block_size,
               num_inference_steps=steps, temperature=0.0, threshold=threshold, editing_threshold=editing_threshold,
               max_post_steps=max_post_steps, eos_token_id=eos, mask_token_id=loaded.dllm.mask_token_id,
               output_type="seq")
    seqs = out.sequences.tolist()
    return [seq[: seq.index(eos) + 1] if eos in seq else seq for seq in seqs]


def pipeline_tokens(loaded, prompt: list[int], gen_length: int, block_size: int, steps: int, threshold: float,
                    editing_threshold: float | None, max_post_steps: int = 16) -> list[int]:
    """:func:`run_pipeline` at batch 1."""
    return run_pipeline(loaded, [prompt], gen_length, block_size, steps, threshold, editing_threshold,
                        max_post_steps)[0]


def checkpoint_dir(loaded, out, shards: int = 1):
    """Write ``loaded`` (a :func:`loaded_llada2`) as LLaDA2 publishes a checkpoint: ``config.json`` with its keys,
    safetensors in its tensor names (``shards`` files + ``model.safetensors.index.json`` when > 1), the
    tokenizer. Returns the directory."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from unmask.engine.families.llada2 import checkpoint_state

    out = Path(out)
    out.mkdir(parents=True)
    cfg = llada2_config_dict(len(loaded.tokenizer), loaded.dllm.mask_token_id, loaded.dllm.eos_token_ids[0],
                             block_length=loaded.dllm.block_size)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = checkpoint_state(loaded.model)
    names = sorted(state)
    if shards == 1:
        save_file(state, str(out / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: state[n] for n in names[i::shards]}
            save_file(part, str(out / file))
            weight_map.update({n: file for n in part})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded.tokenizer.save_pretrained(str(out))
    return out
