"""Tokens/s with and without the exact KV cache (issue 6, benchmark 1; target >= 4x at 256 tokens).

Real 135M model (prefix-causal A2D conversion of SmolLM2-135M-Instruct), block 32, one token per step
(``steps = max_tokens``), greedy, ``ignore_eos`` (every run generates exactly ``max_tokens`` tokens), batch 1.
For each generation length, every repeat runs ``cache=auto`` (exact cache) and ``cache=none`` back to back;
medians over repeats.

Long no-cache runs (``--estimate-above``, default 256 tokens) are *estimated* from sampled blocks rather than run
to the end: without a cache, block b of a generation forwards exactly the tokens ``[0, P + 32 (b + 1))`` at each of
its 32 steps, which is the same forward (same shapes, same mask structure) as the first block of a request whose
prompt is the original prompt followed by ``32 b`` committed tokens. The benchmark times that first block for a
few b, interpolates linearly over all blocks and sums; the JSON marks such rows ``"estimated": true``, and the
256-token length is both run and estimated so that the estimate is checked against a measurement in the same run.

    .venv/bin/python benchmarks/bench_cache.py --lengths 64:3,256:2,1024:1
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import bench_common as bc


def timed_generation(llm, prompt_ids, params) -> tuple[float, int, int]:
    """Seconds, generated tokens and NFE of one generation."""
    t0 = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0].outputs[0]
    return time.perf_counter() - t0, len(out.token_ids), out.nfe


def estimate_nocache(llm, prompt_ids, length, block, samples, filler_ids):
    """Estimated seconds of a no-cache generation of ``length`` tokens from ``samples`` timed blocks."""
    from unmask.engine import SamplingParams

    n_blocks = length // block
    picks = sorted(set(int(round(x)) for x in np.linspace(0, n_blocks - 1, samples)))
    times = {}
    for b in picks:
        ctx = list(prompt_ids) + [filler_ids[i % len(filler_ids)] for i in range(block * b)]
        sp = SamplingParams(max_tokens=block, steps=block, block_size=block, temperature=0, ignore_eos=True,
                            cache="none", seed=0)
        times[b] = timed_generation(llm, ctx, sp)[0]
    xs = sorted(times)
    total = float(sum(np.interp(range(n_blocks), xs, [times[x] for x in xs])))
    return total, {str(k): v for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="64:3,256:2,1024:1", help="LENGTH:REPEATS,...")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the engine's result tokens are read back to the "
                                                     "host every step, so wall times include the GPU work)")
    ap.add_argument("--estimate-above", type=int, default=256,
                    help="no-cache runs of this many tokens or more are estimated from sampled blocks")
    ap.add_argument("--sampled-blocks", type=int, default=4)
    bc.add_weights_argument(ap)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from unmask.engine import LLM, SamplingParams

    lm = bc.real_model(args.model, args.block_size, args.device, weights=args.weights)
    llm = LLM(lm, max_batch_size=1)
    prompt_ids = llm.apply_chat_template([{"role": "user", "content": bc.PROMPT}])
    env = bc.environment(args.threads, args.device)
    bs = args.block_size
    llm.generate([prompt_ids], SamplingParams(max_tokens=bs, steps=bs, block_size=bs, temperature=0,
                                              ignore_eos=True))  # warm
    rows, results = [], []
    write = write_factory(args, lm, prompt_ids, env, bs)
    for item in args.lengths.split(","):
        length, repeats = (int(x) for x in item.split(":"))
        per = {"auto": [], "none": []}
        nfe = {}
        gen_ids = None
        for _ in range(repeats):
            for mode in ("auto", "none"):
                if mode == "none" and length > args.estimate_above:
                    continue
                sp = SamplingParams(max_tokens=length, steps=length, block_size=bs, temperature=0, ignore_eos=True,
                                    cache=mode, seed=0)
                sec, ntok, n = timed_generation(llm, prompt_ids, sp)
                assert ntok == length
                per[mode].append(sec)
                nfe[mode] = n
        if gen_ids is None:
            out = llm.generate([prompt_ids], SamplingParams(max_tokens=bs, steps=bs, block_size=bs, temperature=0,
                                                            ignore_eos=True))[0].outputs[0]
            gen_ids = out.token_ids
        est = None
        if length >= args.estimate_above:
            est_s, sampled = estimate_nocache(llm, prompt_ids, length, bs, args.sampled_blocks, gen_ids)
            est = {"seconds": est_s, "sampled_block_seconds": sampled}
        auto_s = bc.median(per["auto"])
        none_s = bc.median(per["none"]) if per["none"] else est["seconds"]
        res = {"max_tokens": length, "repeats": repeats, "cache_seconds": per["auto"], "nocache_seconds": per["none"],
               "cache_tps": length / auto_s, "nocache_tps": length / none_s, "speedup": none_s / auto_s,
               "nocache_estimated": not per["none"], "nocache_estimate": est, "nfe": nfe}
        if est and per["none"]:
            res["estimate_error"] = est["seconds"] / bc.median(per["none"]) - 1
        results.append(res)
        rows.append([length, repeats, res["cache_tps"], res["nocache_tps"] , f"{res['speedup']:.2f}x",
                     "estimated" if res["nocache_estimated"] else
                     ("measured" + (f" (estimate {100 * res['estimate_error']:+.0f}%)" if est else ""))])
        print(rows[-1], flush=True)
        write(results, rows)  # after every length, so that a long run that is stopped keeps what it measured
    return 0


def write_factory(args, lm, prompt_ids, env, bs):
    def write(results, rows):
        data = {"benchmark": "cache",
                "settings": {"model": lm.path, "weights": lm.weight_format, "attention": lm.dllm.attention, "prompt_tokens": len(prompt_ids),
                             "block_size": bs, "steps": "= max_tokens (one token per step)", "temperature": 0,
                             "remasking": "low_confidence", "ignore_eos": True, "batch": 1,
                             "estimate_above": args.estimate_above, "sampled_blocks": args.sampled_blocks},
                "environment": env, "results": results}
        md = (f"Exact KV cache vs no cache, {lm.path} ({lm.dllm.attention}), prompt {len(prompt_ids)} tokens, block "
              f"{bs}, one token per step, greedy, batch 1. Tokens/s = generated tokens / wall seconds (median).\n\n"
              + bc.markdown_table(["max_tokens", "repeats", "tokens/s cache", "tokens/s no cache", "speedup",
                                   "no-cache number"], rows))

        def plot(path):
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            x = np.arange(len(results))
            ax.bar(x - 0.2, [r["cache_tps"] for r in results], 0.4, label="exact cache")
            ax.bar(x + 0.2, [r["nocache_tps"] for r in results], 0.4, label="no cache")
            ax.set_xticks(x, [str(r["max_tokens"]) for r in results])
            ax.set_xlabel("generated tokens (block 32, one token per step)")
            ax.set_ylabel("tokens/s")
            ax.legend()
            bc.save_figure(fig, path)
        bc.report(bc.result_name("bench_cache", bs), data, md, plot)
    return write


if __name__ == "__main__":
    raise SystemExit(main())
