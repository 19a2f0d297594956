"""LLaDA2 (MoE block diffusion): the engine against diffusers' ``LLaDA2Pipeline`` + ``BlockRefinementScheduler`` on
the same random weights and settings (issue 44).

Two random replicas built in unmask's own model code (``engine/llada2_model.py``), float32 on the CPU: ``tiny`` (the
tests' replica: hidden 64, 3 layers, 8 experts) and ``0.5b`` (hidden 1024, 12 layers, 32 experts of 512 with top-4,
group-limited routing, one shared expert: ~0.6B parameters, ~0.15B active per token). Greedy, LLaDA2's block of 32,
4 steps per block (a quota of 8 commits) with threshold 0.7, 128 new tokens after 32-token prompts, token editing off
(the LLaDA2.0 rule; with ``--editing`` also on at 0.5, for the replicas in ``--editing-replicas``).

* batch 1: each of the first ``--single`` prompts alone, through ``LLM.generate`` and through the pipeline at batch 1;
* batch 8: eight prompts through the engine's continuous batching (``max_batch_size`` 8) and through the pipeline's
  own batch of eight (one call).

Reported per replica and batch: generated tokens per second (median of ``--repeats``, the two sides alternated, so
drifting machine load hits both), the ratio engine / pipeline, and whether the engine's tokens equal the pipeline's
(the pipeline's batch of 8 continues a block while any row edits, so with editing its rows may differ from its own
batch-1 runs).

    .venv/bin/python benchmarks/bench_llada2.py --repeats 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import bench_common as bc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

REPLICAS = {
    "tiny": {},
    "0.5b": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 64, "moe_intermediate_size": 512, "num_experts": 32,
             "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2},
}
PROMPT_LEN, GEN, BLOCK, STEPS, THRESHOLD = 32, 128, 32, 4, 0.7


def engine_run(llm, batch: list[list[int]], editing) -> tuple[float, list[list[int]]]:
    from unmask.engine import SamplingParams

    n_blocks = (PROMPT_LEN + GEN) // BLOCK - PROMPT_LEN // BLOCK
    params = SamplingParams(max_tokens=GEN, temperature=0.0, block_size=BLOCK, threshold=THRESHOLD,
                            steps=STEPS * n_blocks, editing_threshold=editing)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def pipeline_run(loaded, batch: list[list[int]], editing) -> tuple[float, list[list[int]]]:
    from llada2_tiny import run_pipeline

    t0 = time.perf_counter()
    out = run_pipeline(loaded, batch, GEN, BLOCK, STEPS, THRESHOLD, editing)
    return time.perf_counter() - t0, out


def measure(name: str, overrides: dict, args, editing) -> list[dict]:
    """The batch-1 and batch-8 rows of one replica."""
    from llada2_tiny import loaded_llada2
    from unmask.engine import LLM

    loaded = loaded_llada2(seed=0, block_size=BLOCK, **overrides)
    params_total = sum(p.numel() for p in loaded.model.parameters())
    llm = LLM(loaded, max_batch_size=8)
    ps = bc.fixed_prompts(8, PROMPT_LEN, loaded.vocab_size - 8)  # ordinary ids, no special tokens
    engine_run(llm, ps[:1], editing)  # warm-up (first-call allocations, diffusers' imports)
    pipeline_run(loaded, ps[:1], editing)
    rows = []
    for label, batches in (("1", [[p] for p in ps[: args.single]]), ("8", [ps])):
        e_s, p_s, same = [], [], True
        for _ in range(args.repeats):
            es = ps_ = 0.0
            for b in batches:
                t, e_out = engine_run(llm, b, editing)
                es += t
                t, p_out = pipeline_run(loaded, b, editing)
                ps_ += t
                same &= e_out == p_out
            e_s.append(es)
            p_s.append(ps_)
        tokens = sum(len(x) for b in batches for x in engine_run(llm, b, editing)[1])
        e, p = bc.median(e_s), bc.median(p_s)
        rows.append({"replica": name, "parameters": params_total, "batch": label, "editing": editing,
                     "requests": sum(len(b) for b in batches), "tokens": tokens,
                     "engine_tokens_per_s": tokens / e, "pipeline_tokens_per_s": tokens / p,
                     "ratio": p / e, "tokens_equal": bool(same), "engine_seconds": e_s, "pipeline_seconds": p_s})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run both replicas and write ``results/bench_llada2.{json,md}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_replica_arguments(ap)
    ap.add_argument("--editing", action="store_true", help="also with token editing (editing_threshold 0.5)")
    ap.add_argument("--editing-replicas", default="tiny", help="the replicas --editing applies to")
    args = bc.parse_args(ap, argv, threads=1)
    env = bc.environment(args.threads)
    rows = []
    for name in args.replicas.split(","):
        edit = args.editing and name in args.editing_replicas.split(",")
        for editing in (None, 0.5) if edit else (None,):
            rows += measure(name, REPLICAS[name], args, editing)
    md = bc.markdown_table(
        ["replica", "params", "batch", "editing", "engine tok/s", "pipeline tok/s", "engine / pipeline", "same tokens"],
        [[r["replica"], f"{r['parameters'] / 1e6:.3g}M", r["batch"], r["editing"] or "off",
          r["engine_tokens_per_s"], r["pipeline_tokens_per_s"], r["ratio"], r["tokens_equal"]] for r in rows])
    md += (f"\nGreedy, prompts of {PROMPT_LEN} tokens, {GEN} new tokens, block {BLOCK}, {STEPS} steps per block, "
           f"threshold {THRESHOLD}; medians of {args.repeats} alternated repeats; float32 on the CPU. The pipeline "
           "forwards the whole prefix every step (no KV cache); the engine forwards the active block over the exact "
           "cache of the committed ones. With editing, the pipeline's batch shares one step budget and one "
           "post-step decision per block across its rows (a row whose block is full still waits for the others' "
           "masks, and gets no editing steps once the budget is spent), so its batch of 8 does less work than 8 "
           "batch-1 runs and returns other tokens; the engine gives each request its batch-1 answer.\n")
    return bc.report("bench_llada2", {"rows": rows, "environment": env,
                                      "settings": {"prompt_len": PROMPT_LEN, "gen": GEN, "block": BLOCK,
                                                   "steps_per_block": STEPS, "threshold": THRESHOLD}}, md)


if __name__ == "__main__":
    bc.run_script(main)
