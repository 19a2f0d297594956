"""DiffusionGemma: the engine against transformers' ``DiffusionGemmaForBlockDiffusion.generate()`` on the same random
weights and settings (issue 43).

Two random replicas saved in DiffusionGemma's own layout (``tests/diffusion_gemma_tiny.py``) and loaded by the
family adapter, float32 on the CPU: ``tiny`` (the tests' replica: hidden 64, 3 layers, 4 experts, vocabulary 320) and
``0.5b`` (hidden 1024, 12 layers of which every sixth is full attention, 24 experts of 512 with top-4 beside a dense
MLP of 2048, vocabulary 32,000: ~0.55B parameters). Canvases of 32 tokens, 64 new tokens after 32-token prompts,
``max_denoising_steps`` 16, in two sampler settings:

* ``defaults``: transformers' schedule and bound (t 0.4 -> 0.8, entropy bound 0.1, stability 1, confidence 0.005):
  on random weights adaptive stopping never fires, so every canvas takes all its steps on both sides;
* ``settling``: a near-argmax schedule (t 0.05 -> 0.1, entropy bound 1000, confidence 10): canvases settle after a
  varying number of steps, so adaptive stopping fires at different steps for different requests.

Per replica, setting and batch:

* batch 1: each of the first ``--single`` prompts alone, through ``LLM.generate`` and through ``generate()`` at batch 1
  (``torch.manual_seed(seed)``); the tokens must be equal;
* batch 8: eight prompts through the engine's continuous batching (``max_batch_size`` 8) and through ``generate()``'s
  own batch of eight (one call; it draws over its whole batch, so its tokens are not the batch-1 ones, and a row that
  has stopped keeps riding along until every row of the batch has).

Reported: generated tokens per second (median of ``--repeats``, the two sides alternated), the ratio engine /
generate(), and whether the engine's tokens equal ``generate()`` at batch 1 (for batch 8: the engine's batch-8
tokens of the prompts timed alone equal their batch-1 ``generate()`` tokens).

    .venv/bin/python benchmarks/bench_diffusion_gemma.py --repeats 3
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import bench_common as bc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

REPLICAS = {
    "tiny": {},
    "0.5b": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "global_head_dim": 256,
             "num_global_key_value_heads": 2, "sliding_window": 512, "layer_types": None, "num_experts": 24,
             "top_k_experts": 4, "moe_intermediate_size": 512},
}
SETTINGS = {
    "defaults": {"t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1, "stability_threshold": 1,
                 "confidence_threshold": 0.005},
    "settling": {"t_min": 0.05, "t_max": 0.1, "entropy_bound": 1000.0, "stability_threshold": 1,
                 "confidence_threshold": 10.0},
}
PROMPT_LEN, GEN, CANVAS, STEPS, SEED = 32, 64, 32, 16, 1000


def engine_run(llm, batch: list[list[int]], setting: dict, seed: int) -> tuple[float, list[list[int]]]:
    from unmask.engine import SamplingParams

    reqs = [(p, SamplingParams(max_tokens=GEN, seed=seed + i, max_denoising_steps=STEPS, ignore_eos=True, **setting))
            for i, p in enumerate(batch)]
    t0 = time.perf_counter()
    out = dict(llm.generate_iter(reqs, lookahead=len(reqs)))
    return time.perf_counter() - t0, [out[i].outputs[0].token_ids for i in range(len(reqs))]


def reference_run(model, batch: list[list[int]], setting: dict, seed: int) -> tuple[float, list[list[int]]]:
    """``generate()`` over ``batch`` in one call after ``torch.manual_seed(seed)`` (EOS ignored, as the engine's
    ``ignore_eos``: its output keeps every canvas; no pad replaces tokens after an EOS)."""
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    kw = {k: v for k, v in setting.items() if k != "entropy_bound"}
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(torch.tensor(batch), max_new_tokens=GEN, max_denoising_steps=STEPS, eos_token_id=None,
                         pad_token_id=None, sampler_config=EntropyBoundSamplerConfig(setting["entropy_bound"]),
                         **kw)
    return time.perf_counter() - t0, out.sequences[:, PROMPT_LEN:].tolist()


def measure(name: str, overrides: dict, args) -> list[dict]:
    """The batch-1 and batch-8 rows of one replica, per sampler setting."""
    from diffusion_gemma_tiny import save_replica
    from unmask.engine import LLM
    from unmask.engine.model import load_model

    with tempfile.TemporaryDirectory() as tmp:
        save_replica(tmp, canvas_length=CANVAS, **overrides)
        loaded = load_model(tmp, device="cpu")
    model = loaded.model
    params_total = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n)
    llm = LLM(loaded, max_batch_size=8, enable_prefix_caching=False)  # the repeats resend the same prompts
    ps = bc.fixed_prompts(8, PROMPT_LEN, min(loaded.vocab_size, 320) - 1)  # ordinary ids
    rows = []
    for sname, setting in SETTINGS.items():
        engine_run(llm, ps[:1], setting, SEED)  # warm-up
        reference_run(model, ps[:1], setting, SEED)
        for label, batches in (("1", [[p] for p in ps[: args.single]]), ("8", [ps])):
            e_s, r_s, same, tokens = [], [], True, 0
            for _ in range(args.repeats):
                es = rs = 0.0
                tokens = 0
                for i, b in enumerate(batches):
                    seed = SEED + i if label == "1" else SEED
                    t, e_out = engine_run(llm, b, setting, seed)
                    es += t
                    tokens += sum(len(x) for x in e_out)
                    t, r_out = reference_run(model, b, setting, seed)
                    rs += t
                    if label == "1":
                        same &= e_out == r_out
                    else:  # the prompts timed alone: their batch-1 generate() tokens
                        alone = [reference_run(model, [p], setting, SEED + j)[1][0] for j, p in
                                 enumerate(b[: args.single])] if not e_s else None
                        if alone is not None:
                            same &= e_out[: args.single] == alone
                e_s.append(es)
                r_s.append(rs)
            e, r = bc.median(e_s), bc.median(r_s)
            rows.append({"replica": name, "parameters": params_total, "setting": sname, "batch": label,
                         "requests": sum(len(b) for b in batches), "tokens": tokens,
                         "engine_tokens_per_s": tokens / e, "generate_tokens_per_s": tokens / r, "ratio": r / e,
                         "tokens_equal_batch1_generate": bool(same), "engine_seconds": e_s, "generate_seconds": r_s})
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the replicas and write ``results/bench_diffusion_gemma.{json,md}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_replica_arguments(ap)
    args = bc.parse_args(ap, argv, threads=1)
    env = bc.environment(args.threads)
    rows = []
    for name in args.replicas.split(","):
        rows += measure(name, REPLICAS[name], args)
    md = bc.markdown_table(
        ["replica", "params (text)", "setting", "batch", "engine tok/s", "generate() tok/s", "engine / generate()",
         "= generate() at batch 1"],
        [[r["replica"], f"{r['parameters'] / 1e6:.3g}M", r["setting"], r["batch"], r["engine_tokens_per_s"],
          r["generate_tokens_per_s"], r["ratio"], r["tokens_equal_batch1_generate"]] for r in rows])
    md += (f"\nPrompts of {PROMPT_LEN} tokens, {GEN} new tokens (EOS ignored on both sides), canvases of {CANVAS}, "
           f"max_denoising_steps {STEPS}; medians of {args.repeats} alternated repeats; float32 on the CPU, "
           f"{args.threads} thread(s). Both sides run transformers' modules on the same weights; the engine's batch "
           "of 8 is continuous batching (a request leaves when its canvases are done, a canvas when its own "
           "adaptive stopping fires), generate()'s is one call (every row steps until the whole batch stops).\n")
    return bc.report("bench_diffusion_gemma", {"rows": rows, "environment": env,
                                               "settings": {"prompt_len": PROMPT_LEN, "gen": GEN, "canvas": CANVAS,
                                                            "max_denoising_steps": STEPS, "samplers": SETTINGS}}, md)


if __name__ == "__main__":
    bc.run_script(main)
