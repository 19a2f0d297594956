"""Draft-head speculative decoding on the real model: tokens per forward and tokens/s per draft block and reveal
threshold, against one-token-per-forward decoding of the same checkpoint (the verifier alone) in the same run.

Greedy, batch 1, the first ``--prompts`` prompts of the 60-prompt evaluation grid (chat template), ``--repeats``
timed passes each (median tokens/s per prompt, then the median over prompts). Every setting returns the same tokens
(exact verification), which the benchmark checks. Writes ``benchmarks/results/bench_draft_head.{json,md}`` (a rerun overwrites them).

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_draft_head.py --model OUT_OF_TRAIN_HEAD --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, grid_prompts, markdown_table, result_name, set_threads, write_results  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint with a draft head (unmask train-head OUT)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 5])
    ap.add_argument("--thresholds", type=float, nargs="+", default=[1.0, 0.9, 0.7, 0.0],
                    help="head reveal thresholds (1.0 = one draft per head forward)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    set_threads(args.threads)
    from unmask.engine import LLM, SamplingParams

    llm = LLM(args.model)
    head = llm.model.draft_head
    if head is None:
        raise SystemExit(f"{args.model}: has no draft head (dllm.draft_head)")
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in (r["prompt"] for r in grid_prompts(args.prompts))]
    settings = [(1, 1.0)] + [(b, t) for b in args.blocks for t in args.thresholds]
    llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0, block_size=4, speculative=True))  # warm-up
    rows, results, reference = [], [], None
    for block, thr in settings:
        head.cfg.reveal_threshold = thr
        per_prompt, tokens, nfe, outs = [], 0, 0, []
        for p in prompts:
            rates = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                o = llm.generate(p, SamplingParams(max_tokens=args.max_tokens, temperature=0, block_size=block,
                                                   speculative=True))[0].outputs[0]
                rates.append(len(o.token_ids) / (time.perf_counter() - t0))
            per_prompt.append(statistics.median(rates))
            tokens += len(o.token_ids)
            nfe += o.nfe
            outs.append(o.token_ids)
        if reference is None:
            reference = outs
        same = sum(a == b for a, b in zip(outs, reference))
        rec = {"block_size": block, "reveal_threshold": thr if block > 1 else None, "tpf": tokens / nfe,
               "tokens_per_s_median": statistics.median(per_prompt), "tokens_per_s_per_prompt": per_prompt,
               "tokens": tokens, "forwards": nfe, "identical_to_block1": same}
        results.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "tokens_per_s_per_prompt"}), flush=True)
    base = results[0]["tokens_per_s_median"]
    for r in results:
        r["speedup_vs_block1"] = r["tokens_per_s_median"] / base
        rows.append([f"b{r['block_size']}" + ("" if r["block_size"] == 1 else f" thr {r['reveal_threshold']}"),
                     r["tpf"], r["tokens_per_s_median"], r["speedup_vs_block1"],
                     f"{r['identical_to_block1']}/{len(prompts)}"])
    md = ("Draft-head speculative decoding (greedy, exact), batch 1, first "
          f"{args.prompts} grid prompts, <= {args.max_tokens} tokens, median of {args.repeats} passes per prompt; "
          "b1 = the same checkpoint one token per forward (the verifier alone).\n\n"
          + markdown_table(["setting", "TPF", "tok/s (median)", "x b1", "answers = b1"], rows))
    write_results(result_name("bench_draft_head"), {"settings": vars(args), "environment": environment(args.threads),
                              "results": results}, md)


if __name__ == "__main__":
    main()
