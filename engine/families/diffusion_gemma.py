"""``diffusion_gemma``: Google's DiffusionGemma (``google/diffusiongemma-26B-A4B-it``; ``model_type:
diffusion_gemma``, ``DiffusionGemmaForBlockDiffusion``), loaded with transformers' own classes (5.25+, no remote
code) and decoded by the uniform-canvas strategy (``unmask.engine.uniform_canvas``).

The checkpoint is transformers' layout as ``save_pretrained`` writes it: an encoder (``model.encoder.language_model``,
Gemma 4 text layers: alternating sliding-window and full attention, a dense GELU MLP beside a router + stacked
experts MoE) that reads the prompt and each finished canvas once into its KV cache, a decoder
(``model.decoder``, the same layers and weights, tied) that refines a canvas of ``canvas_length`` tokens with
bidirectional attention over that cache and itself plus a self-conditioning MLP, the tied LM head with a final
logit soft-cap, and a Gemma 4 vision tower. Only the text path is served: a request with images is refused (the
server's 400 names the field).

Settings: no mask token (the canvas is uniform noise; ``DllmConfig.mask_token_id`` is the first id past the
vocabulary, a sentinel that can never be sampled or sent), block = ``canvas_length`` (fixed), EOS from
``config.json`` / ``generation_config.json``. The linear layers run as loaded (no fp16/int packing): the family's
contract is token-for-token equality with ``generate()`` (docs/design.md#model-families).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint_check import check_loading_info, check_tensor_names, check_weight_files
from ..config import CheckpointError, DllmConfig, read_json_file
from ..uniform_options import TRANSFORMERS_DEFAULTS
from . import FamilyAdapter
from .common import load_tokenizer_without_remote_code, resolve_eos_token_ids, resolve_pad_token_id

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
MODEL_TYPE = "diffusion_gemma"
MIN_TRANSFORMERS = (5, 25)
DEFAULT_EOS_IDS = [1]  # Gemma's <eos>


def detect(config: dict) -> bool:
    """``architectures`` contains ``DiffusionGemmaForBlockDiffusion`` or ``model_type == "diffusion_gemma"``."""
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("model_type") == MODEL_TYPE


def require_transformers(where: str = "diffusion_gemma") -> None:
    """Raise :class:`CheckpointError` unless the installed transformers has DiffusionGemma (5.25 or later)."""
    import transformers

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS or not hasattr(transformers, ARCHITECTURE):
        raise CheckpointError(f"{where}: DiffusionGemma needs transformers >= "
                              f"{'.'.join(map(str, MIN_TRANSFORMERS))} (its {ARCHITECTURE}); this environment has "
                              f"{transformers.__version__}: pip install 'transformers>=5.25'")


def _text_config(config: dict, where: Path) -> dict:
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: missing `text_config` (not a DiffusionGemma config?)")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "top_k_experts"):
        if not isinstance(text.get(key), int) or isinstance(text.get(key), bool) or text[key] < 1:
            raise CheckpointError(f"{where}:text_config.{key}: a positive integer is required, got {text.get(key)!r}")
    canvas = config.get("canvas_length", 256)
    if not isinstance(canvas, int) or isinstance(canvas, bool) or canvas < 1:
        raise CheckpointError(f"{where}:canvas_length: a positive integer is required, got {canvas!r}")
    context = text.get("max_position_embeddings", 4096)
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise CheckpointError(f"{where}:text_config.max_position_embeddings: a positive integer is required, got "
                              f"{context!r}")
    if canvas > context:
        raise CheckpointError(f"{where}:canvas_length: {canvas} exceeds the context "
                              f"(text_config.max_position_embeddings {context})")
    return text


def dllm_config(path: Path, config: dict, tokenizer) -> DllmConfig:
    """The family's :class:`DllmConfig` (module docstring)."""
    text = _text_config(config, path / "config.json")
    vocab = int(text["vocab_size"])
    gen = read_json_file(path / "generation_config.json") or {}
    merged = {**text, **{k: v for k, v in config.items() if k in ("eos_token_id", "pad_token_id")}}
    eos = resolve_eos_token_ids(path, merged, tokenizer, ("<eos>", "<end_of_turn>"), DEFAULT_EOS_IDS, vocab,
                                generation_config=gen)
    sampling = sampler_defaults(gen)
    t_min, t_max = (sampling.get(k, TRANSFORMERS_DEFAULTS[k]) for k in ("t_min", "t_max"))
    if all(isinstance(t, (int, float)) for t in (t_min, t_max)) and t_max <= t_min:  # transformers' own rule
        raise CheckpointError(f"{path / 'generation_config.json'}:t_max: must be > t_min ({t_min}), got {t_max}")
    try:
        return DllmConfig(family="diffusion_gemma", mask_token_id=vocab, attention="bidirectional",
                          block_size=int(config.get("canvas_length", 256)), logit_shift=False, eos_token_ids=eos,
                          pad_token_id=resolve_pad_token_id(merged, tokenizer, eos, vocab), fixed_block_size=True,
                          default_sampling=sampling)
    except CheckpointError as exc:  # the sampling defaults come from generation_config.json alone: name it
        head, sep, rest = str(exc).partition(".default_sampling.")
        if not sep:
            raise
        raise CheckpointError(f"{path / 'generation_config.json'}:{rest}") from exc


def sampler_defaults(gen: dict) -> dict:
    """The uniform-canvas options ``generation_config.json`` sets (``sampler_config.entropy_bound`` included)."""
    out = {k: gen[k] for k in TRANSFORMERS_DEFAULTS if gen.get(k) is not None}
    bound = (gen.get("sampler_config") or {}).get("entropy_bound") if isinstance(gen.get("sampler_config"), dict) \
        else None
    if bound is not None:
        out["entropy_bound"] = bound
    return out


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype):
    """Load a DiffusionGemma checkpoint directory with ``DiffusionGemmaForBlockDiffusion.from_pretrained``
    (sdpa attention, ``dtype`` on ``device``).

    Raises:
        CheckpointError: transformers older than 5.25; a config without a text config or a canvas length; a
            missing, unexpected or misshapen tensor (naming the weight file and the tensor).
    """
    from ..loaded import LoadedModel

    path = Path(path)
    require_transformers(str(path / "config.json"))
    from transformers import DiffusionGemmaForBlockDiffusion

    tokenizer = load_tokenizer_without_remote_code(path)
    dllm = dllm_config(path, config, tokenizer)
    headers = check_weight_files(path)
    if headers is not None:  # transformers fills a missing tensor with random values and only logs it
        check_tensor_names(path, headers, DiffusionGemmaForBlockDiffusion)
    model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                                  output_loading_info=True)
    check_loading_info(path, ARCHITECTURE, info)
    model = model.to(device).eval()
    text = config["text_config"]
    return LoadedModel(model=model, tokenizer=tokenizer, dllm=dllm, path=str(path), device=device, dtype=dtype,
                       max_context=int(text.get("max_position_embeddings", 4096)))


ADAPTER = FamilyAdapter(name="diffusion_gemma", detect=detect, load=load)
