"""Engine overhead per step against a bare model forward of the same input shape (issue 2; target < 10%).

What is compared, step by step, at batch 1:

* engine step: ``Scheduler.step()`` wall time - building the lane inputs and the 4-D mask, the KV-cache view, the
  decoder forward, the LM head on the rows the step reads, sampling, reveal, EOS/stop checks, the event.
* bare forward: the model's own decoder forward (the fused decoder of packed Llama models, else transformers) on
  exactly the same ``input_ids``/``position_ids``/boolean mask, with a transformers ``DynamicCache`` holding as
  many cached tokens as the engine's cache had, plus the same LM head on as many rows as the engine read. This is
  the least any implementation of the step must compute.

The shapes of every step are recorded in an untimed warm-up generation (greedy decoding, so every repeat forwards
the same shapes); then each repeat times one engine generation step by step, and the bare forwards of the same
shapes. Overhead = sum of per-step medians (engine) / sum of per-step medians (bare) - 1.

    .venv/bin/python benchmarks/bench_overhead.py --max-tokens 64 --block-size 32 --repeats 3
"""
from __future__ import annotations

import argparse
import time

import torch

import bench_common as bc


def record_shapes(llm, prompt_ids, params):
    """Run one generation, recording per forward: ids, positions, mask, cached length, LM-head rows."""
    lm = llm.model
    shapes = []
    orig_hidden, orig_logits = lm.hidden_states, lm.logits  # the compiled decoder, if any, runs inside these

    def hidden_states(input_ids, position_ids, attention_mask, cache=None, variant_rows=None):
        shapes.append({"input_ids": input_ids.clone(), "position_ids": position_ids.clone(),
                       "mask": attention_mask.clone(), "cached": cache.cached_len if cache is not None else 0})
        return orig_hidden(input_ids, position_ids, attention_mask, cache=cache, variant_rows=variant_rows)

    def logits(hidden, variant_rows=None):
        shapes[-1]["head_rows"] = int(hidden.shape[0])
        return orig_logits(hidden, variant_rows=variant_rows)

    lm.hidden_states = hidden_states
    lm.logits = logits
    try:
        run_engine(llm, prompt_ids, params)
    finally:
        del lm.logits
        del lm.hidden_states
    return shapes


def run_engine(llm, prompt_ids, params) -> list[float]:
    """One generation through the scheduler; returns the wall time of every step (seconds)."""
    from unmask.engine.scheduler import Scheduler

    seq = llm.make_sequences(prompt_ids, params, "bench")[0]
    sched = Scheduler(llm.denoiser, max_batch_size=1)
    sched.add(seq)
    times = []
    while sched.has_work():
        t0 = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t0)
    return times


@torch.inference_mode()
def run_bare(lm, shapes) -> list[float]:
    """The bare forwards of the recorded shapes through the model's own forward (``LoadedModel.hidden_states``:
    the fused decoder of packed Llama models, else transformers), with a transformers ``DynamicCache`` holding as
    many cached tokens as the engine's cache had, and the LM head on as many rows; returns each wall time (s)."""
    from transformers import DynamicCache

    head = lm.model.get_output_embeddings()
    cfg = lm.model.config
    n_kv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    times = []
    for s in shapes:
        cache = None
        if s["cached"]:
            cache = DynamicCache(config=cfg)
            for layer in range(cfg.num_hidden_layers):
                cache.update(torch.randn(1, n_kv, s["cached"], d), torch.randn(1, n_kv, s["cached"], d), layer)
        t0 = time.perf_counter()
        hidden = lm.hidden_states(s["input_ids"], s["position_ids"], s["mask"], cache=cache)
        head(hidden[0, : s["head_rows"]]).float()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the converted SmolLM2-135M in /tmp)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="auto")
    ap.add_argument("--compile", action="store_true", help="torch.compile the engine's forward")
    args = bc.parse_args(ap, argv, threads=1)
    from unmask.engine import LLM, SamplingParams

    lm = bc.real_model(args.model, args.block_size,
                       weights="native" if args.compile and args.weights == "auto" else args.weights)
    llm = LLM(lm, max_batch_size=1, **({"compile": True} if args.compile else {}))
    prompt_ids = llm.apply_chat_template([{"role": "user", "content": bc.PROMPT}])
    params = SamplingParams(max_tokens=args.max_tokens, steps=args.max_tokens, block_size=args.block_size,
                            temperature=0, ignore_eos=True, cache=args.cache, seed=0)
    env = bc.environment(args.threads)
    t0 = time.perf_counter()
    shapes = record_shapes(llm, prompt_ids, params)
    env["first_generation_s"] = time.perf_counter() - t0  # includes torch.compile's compilation with --compile
    run_bare(lm, shapes[:2])  # warm the bare path too
    engine_runs, bare_runs = [], []
    for _ in range(args.repeats):
        engine_runs.append(run_engine(llm, prompt_ids, params))
        bare_runs.append(run_bare(lm, shapes))
    n = len(shapes)
    assert all(len(r) == n for r in engine_runs), "the engine ran a different number of steps than recorded"
    eng = [bc.median([r[i] for r in engine_runs]) for i in range(n)]
    bare = [bc.median([r[i] for r in bare_runs]) for i in range(n)]
    overhead = sum(eng) / sum(bare) - 1
    per_step = [e / b - 1 for e, b in zip(eng, bare)]
    run_overheads = [sum(e) / sum(b) - 1 for e, b in zip(engine_runs, bare_runs)]
    data = {
        "benchmark": "overhead",
        "settings": {"model": lm.path, "weights": lm.weight_format, "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens,
                     "block_size": args.block_size, "steps": n, "temperature": 0, "remasking": "low_confidence",
                     "cache": args.cache, "batch": 1, "repeats": args.repeats, "compile": args.compile,
                     "attention": lm.dllm.attention},
        "environment": env,
        "steps": [{"q": int(s["input_ids"].shape[1]), "cached": s["cached"], "head_rows": s["head_rows"],
                   "engine_s": e, "bare_s": b} for s, e, b in zip(shapes, eng, bare)],
        "engine_step_median_s": bc.median(eng), "bare_forward_median_s": bc.median(bare),
        "overhead": overhead, "overhead_per_step_median": bc.median(per_step),
        "overhead_per_repeat": run_overheads, "target": 0.10, "pass": overhead < 0.10,
    }
    md = bc.markdown_table(
        ["steps", "engine step (median, ms)", "bare forward (median, ms)", "overhead (sum of medians)",
         "overhead (median of steps)", "overhead per repeat", "target"],
        [[n, 1e3 * bc.median(eng), 1e3 * bc.median(bare), f"{100 * overhead:.1f}%",
          f"{100 * bc.median(per_step):.1f}%", ", ".join(f"{100 * x:.1f}%" for x in run_overheads), "< 10%"]])
    md = (f"Engine step vs bare forward, batch 1, {lm.path}, prompt {len(prompt_ids)} tokens, max_tokens "
          f"{args.max_tokens}, block {args.block_size}, one token per step, greedy, cache={args.cache}.\n\n" + md)

    def plot(path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([1e3 * x for x in eng], label="engine step")
        ax.plot([1e3 * x for x in bare], label="bare forward (same shape)")
        ax.set_xlabel("step")
        ax.set_ylabel("ms (median over repeats)")
        ax.set_title(f"Per-step engine overhead: {100 * overhead:.1f}%")
        ax.legend()
        bc.save_figure(fig, path)

    name = bc.result_name("bench_overhead", args.block_size) + ("_compile" if args.compile else "")
    out = bc.write_results(name, data, md, plot)
    print(md)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
