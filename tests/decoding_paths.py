"""Every decoding path of the engine, as data: the checkpoints (tiny random models written to disk, so that
``load_model`` runs its whole load order) and the requests that take each path.

One list for every device check: the mixed-device harness (``tests/engine/test_device_tags.py``: fake CUDA on the
CPU), the ``cuda`` test lane and ``benchmarks/gpu_check.py`` run the same paths and compare the tokens with a CPU
float32 run. Needs only torch, transformers and llguidance (constrained paths).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

import tiny

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 3}, "ok": {"type": "boolean"}}}
PROMPTS = ("Hello world the quick brown", "the quick brown fox jumps", "Hello world")


@dataclass(frozen=True)
class DecodingPath:
    """A path: ``checkpoint`` (a key of :func:`write_checkpoints`), the request's ``SamplingParams.from_flat``
    keywords, and whether the batch reuses a prefix (two requests, the second extending the first's prompt)."""

    name: str
    checkpoint: str
    params: dict = field(default_factory=dict)
    prefix_reuse: bool = False
    constrained: bool = False


GREEDY = dict(temperature=0, speculative=False)
SAMPLED = dict(temperature=1.0, seed=7, speculative=False)
PATHS = (
    DecodingPath("quota", "causal", dict(GREEDY, block_size=4)),
    DecodingPath("threshold", "causal", dict(GREEDY, block_size=4, threshold=0.3)),
    DecodingPath("sampled-top-k-top-p", "causal", dict(SAMPLED, block_size=4, top_k=20, top_p=0.9)),
    DecodingPath("remasking-margin", "causal", dict(GREEDY, block_size=4, remasking="margin")),
    DecodingPath("remasking-entropy", "causal", dict(GREEDY, block_size=4, remasking="entropy")),
    DecodingPath("remasking-random", "causal", dict(SAMPLED, block_size=4, remasking="random")),
    DecodingPath("remasking-left-to-right", "causal", dict(GREEDY, block_size=4, remasking="left_to_right")),
    DecodingPath("cache-none", "causal", dict(GREEDY, block_size=4, cache="none")),
    DecodingPath("bidirectional-cache-none", "bidirectional", dict(GREEDY, block_size=4, cache="none")),
    DecodingPath("bidirectional-cache-prefix", "bidirectional", dict(GREEDY, block_size=4, cache="prefix")),
    DecodingPath("bidirectional-cache-dual", "bidirectional", dict(GREEDY, block_size=4, cache="dual")),
    DecodingPath("cfg", "bidirectional", dict(GREEDY, block_size=4, cfg_scale=1.0, cache="none")),
    DecodingPath("block-causal", "block_causal", dict(GREEDY)),
    DecodingPath("multi-block", "causal", dict(GREEDY, block_size=4, multi_block=0.5)),
    DecodingPath("sub-blocks", "causal", dict(GREEDY, block_size=8, sub_block_size=4)),
    DecodingPath("speculative-greedy", "causal", dict(temperature=0, block_size=4, speculative=True)),
    DecodingPath("speculative-sampled", "causal", dict(temperature=1.0, seed=3, block_size=4, speculative=True)),
    DecodingPath("constrained-plain", "causal", dict(GREEDY, block_size=4), constrained=True),
    DecodingPath("constrained-threshold", "causal", dict(GREEDY, block_size=4, threshold=0.3), constrained=True),
    DecodingPath("constrained-speculative", "causal", dict(temperature=0, block_size=4, speculative=True),
                 constrained=True),
    DecodingPath("penalties", "causal", dict(GREEDY, block_size=4, presence_penalty=0.5, frequency_penalty=0.5,
                                             repetition_penalty=1.3)),
    DecodingPath("logit-bias-min-tokens", "causal", dict(GREEDY, block_size=4, logit_bias={5: 5.0, 6: -100.0},
                                                         min_tokens=4)),
    DecodingPath("logprobs-stop", "causal", dict(GREEDY, block_size=4, logprobs=True, stop=["zz"])),
    DecodingPath("prefix-reuse", "causal", dict(GREEDY, block_size=4), prefix_reuse=True),
    DecodingPath("adapter-default", "adapter", dict()),
    DecodingPath("adapter-plain", "adapter", dict(GREEDY, block_size=4)),
    DecodingPath("adapter-block-1", "adapter", dict(temperature=0, block_size=1)),
    DecodingPath("adapter-constrained", "adapter", dict(GREEDY, block_size=2), constrained=True),
    DecodingPath("llada2-refinement", "llada2", dict(GREEDY, threshold=0.6)),
    DecodingPath("llada2-editing", "llada2", dict(SAMPLED, threshold=0.6, editing_threshold=0.4)),
)


def write_checkpoints(out: Path) -> dict[str, Path]:
    """The tiny checkpoints the paths name, written under ``out``: ``causal`` (prefix-causal A2D), ``bidirectional``
    (LLaDA-style), ``block_causal`` (SDAR-style, fixed block 4), ``adapter`` (an adapter-only directory on the
    causal parent, greedy speculative by default) and ``llada2`` (LLaDA2's MoE layout, block 8). Returns
    ``{name: directory}``."""
    from unmask.engine.adapter_files import parent_hash, write_adapter
    from unmask.engine.checkpoint import write_checkpoint

    dirs = {}
    for name, kw in (("causal", dict(attention="prefix_causal")), ("bidirectional", dict(attention="bidirectional",
                     logit_shift=False)), ("block_causal", dict(attention="block_causal", block_alignment="absolute",
                                                                fixed_block_size=True))):
        m = tiny.loaded(block_size=4, initializer_range=0.5, **kw)
        dirs[name] = write_checkpoint(out / name, m.model, m.tokenizer, m.dllm)
    parent = tiny.loaded(block_size=4, initializer_range=0.5)
    w = tiny.random_adapter_weights(parent)
    write_adapter(out / "adapter", w, {"sha256": parent_hash(dirs["causal"]), "name": str(dirs["causal"])},
                  dllm={"block_size": 4, "default_sampling": {"speculative": True, "temperature": 0.0}})
    dirs["adapter"] = out / "adapter"
    from llada2_tiny import checkpoint_dir, loaded_llada2

    dirs["llada2"] = checkpoint_dir(loaded_llada2(seed=0), out / "llada2")  # MoE block refinement (LLaDA2.x)
    return dirs


def run_path(llm, path: DecodingPath, max_tokens: int = 12) -> list[list[int]]:
    """Generate the path's requests with ``llm`` (an :class:`unmask.engine.LLM`); returns each request's token ids.

    Three prompts decode in one batch (continuous batching, different lengths); ``prefix_reuse`` runs a second call
    whose prompt extends the first's, so its prefill reads the prefix cache."""
    from unmask.engine import Constraint, SamplingParams

    kw = dict(path.params, max_tokens=max_tokens, ignore_eos=not path.constrained)
    if path.constrained:
        kw["constraint"] = Constraint("json_schema", SCHEMA)
        kw["max_tokens"] = 48
    params = SamplingParams.from_flat(**kw)
    outs = llm.generate(list(PROMPTS), params)
    if path.prefix_reuse:
        outs += llm.generate([PROMPTS[0] + " fox jumps over"], params)
    return [o.outputs[0].token_ids for o in outs]


def device_dtypes() -> list[tuple[str, torch.dtype]]:
    """The (device, dtype) pairs a real-GPU lane checks: CUDA float32 and bfloat16 where CUDA is available."""
    if not torch.cuda.is_available():
        return []
    return [("cuda", torch.float32), ("cuda", torch.bfloat16)]
