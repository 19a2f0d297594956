"""Quality change of the approximate (Fast-dLLM-style) caches for bidirectional models (issue 6).

``prefix`` and ``dual`` caches reuse keys/values computed at the first step of a block for the rest of the block,
so tokens can differ from ``cache=none``. No real bidirectional model is available offline, so this measures on
tiny random bidirectional Llamas (``tests/tiny.py``, several weight seeds): the share of generated positions whose
token equals the ``cache=none`` token, the share of exactly equal outputs, and the tokens forwarded per step
(the compute each policy pays; the real saving grows with the canvas length). Random weights are a stress test
(flat, unconfident distributions change more easily than a trained model's); read it as "how often the
approximation flips a token", not as the quality loss on a real model.

    .venv/bin/python benchmarks/bench_bidir_cache.py
"""
from __future__ import annotations

import argparse
import os
import sys

import bench_common as bc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Paris is", "def add(a, b):",
           "One two three four", "What is the capital of France?"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-seeds", default="0,1,2")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--blocks", default="4,8,32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from tiny import loaded

    from unmask.engine import LLM, SamplingParams

    env = bc.environment(args.threads)
    settings = []
    for block in (int(b) for b in args.blocks.split(",")):
        settings.append(("quota, 1 token/step", block, {}))
        settings.append(("threshold 0.05", block, {"threshold": 0.05}))
    stats = {}
    for mseed in (int(s) for s in args.model_seeds.split(",")):
        llm = LLM(loaded(attention="bidirectional", seed=mseed))
        fwd = {"n": 0}
        orig = llm.model.hidden_states

        def counting(input_ids, position_ids, attention_mask, cache=None, variant_rows=None, _orig=orig):
            fwd["n"] += int(input_ids.numel())
            return _orig(input_ids, position_ids, attention_mask, cache=cache, variant_rows=variant_rows)

        llm.model.hidden_states = counting
        for name, block, extra in settings:
            for prompt in PROMPTS:
                outs = {}
                for mode in ("none", "prefix", "dual"):
                    fwd["n"] = 0
                    sp = SamplingParams(max_tokens=args.max_tokens, block_size=block, temperature=0, ignore_eos=True,
                                        cache=mode, **extra)
                    o = llm.generate(prompt, sp)[0].outputs[0]
                    outs[mode] = (o.token_ids, fwd["n"] / max(o.steps, 1), len(o.token_ids) / max(o.steps, 1))
                ref = outs["none"][0]
                for mode, (toks, per_step, tps) in outs.items():
                    s = stats.setdefault((name, block, mode), {"agree": 0, "total": 0, "exact": 0, "runs": 0,
                                                               "fwd_tokens_per_step": [], "tokens_per_step": []})
                    s["agree"] += sum(a == b for a, b in zip(toks, ref))
                    s["total"] += len(ref)
                    s["exact"] += int(toks == ref)
                    s["runs"] += 1
                    s["fwd_tokens_per_step"].append(per_step)
                    s["tokens_per_step"].append(tps)
    rows, results = [], []
    for (name, block, mode), s in stats.items():
        r = {"setting": name, "block_size": block, "cache": mode, "token_agreement": s["agree"] / s["total"],
             "exact_outputs": s["exact"] / s["runs"], "runs": s["runs"],
             "forwarded_tokens_per_step": bc.median(s["fwd_tokens_per_step"]),
             "tokens_per_step": bc.median(s["tokens_per_step"])}
        results.append(r)
        rows.append([name, block, mode, f"{100 * r['token_agreement']:.1f}%", f"{100 * r['exact_outputs']:.0f}%",
                     r["forwarded_tokens_per_step"], r["tokens_per_step"]])
    data = {"benchmark": "bidir_cache",
            "settings": {"models": "tests/tiny.py loaded(attention='bidirectional', seed=s)",
                         "model_seeds": args.model_seeds, "prompts": PROMPTS, "max_tokens": args.max_tokens,
                         "temperature": 0, "ignore_eos": True},
            "environment": env, "results": results}
    md = ("Approximate caches for bidirectional models vs `cache=none` (tiny random bidirectional Llamas, "
          f"{len(PROMPTS)} prompts x {len(args.model_seeds.split(','))} weight seeds, {args.max_tokens} tokens, "
          "greedy). Agreement = share of positions with the `none` token; forwarded tokens per step = the compute "
          "proxy (median).\n\n"
          + bc.markdown_table(["decoding", "block", "cache", "token agreement", "identical outputs",
                               "forwarded tokens/step", "tokens revealed/step"], rows))
    print(md)
    print("wrote", bc.write_results("bench_bidir_cache", data, md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
