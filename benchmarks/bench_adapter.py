"""The mask-row adapter on the real model (docs/design.md#mask-row-adapter, docs/adapter.md): speed, TPF and answers.

Decodes the first ``--prompts`` prompts of the held-out grid (``benchmarks/data/eval_grid_ids.json``, chat
template, greedy, ``--max-tokens``) one at a time, in every mode, ``--repeats`` times (medians of the per-mode
totals):

* ``parent-b1``: the untrained A2D conversion at block 1 (exactly the AR parent through the engine);
* ``adapter-b1``: the adapter model at block 1 (must give the same tokens: only the parent's weights run);
* ``adapter-spec``: verified speculative decoding, drafts from the adapter's mask rows (same tokens as parent-b1);
* ``self-spec``: the untrained conversion drafting for itself (the baseline the adapter replaces);
* ``adapter-b4-t<τ>``: plain diffusion with the adapter, block 4, threshold τ (``--thresholds``);
* ``parent-b4-t<τ>``: the same decoding on the untrained conversion.

Reports tokens/s (generated tokens / wall seconds, per mode), TPF (tokens / forwards), identity with the
parent's answers and exact-match accuracy on the checkable prompts. Writes
``benchmarks/results/adapter/bench_adapter.{json,md}``.

Usage::

    nice -n 5 .venv/bin/python benchmarks/bench_adapter.py --adapter DIR [--prompts 16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import quality_metrics as qm  # noqa: E402

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", required=True, help="adapter directory (adapter-only or self-contained)")
    ap.add_argument("--parent", default=None, help="the parent a2d directory (default: the adapter's hint)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--thresholds", default="0.9,0.7,0.5")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-name", default="adapter/bench_adapter")
    bc.add_weights_argument(ap)
    args = ap.parse_args()
    bc.set_threads(args.threads)
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.adapter_files import resolve_adapter
    from unmask.engine.model import load_model

    parent_dir, _ = resolve_adapter(Path(args.adapter), None, args.parent)
    adapted = LLM(load_model(args.adapter, parent=args.parent, weights=args.weights), max_batch_size=1)
    parent = LLM(load_model(parent_dir, weights=args.weights), max_batch_size=1)
    prompts = bc.grid_prompts(args.prompts)
    base = dict(max_tokens=args.max_tokens, temperature=0.0)
    modes = {"parent-b1": (parent, dict(block_size=1, speculative=False)),
             "adapter-b1": (adapted, dict(block_size=1, speculative=False)),
             "adapter-spec": (adapted, dict(block_size=4, speculative=True)),
             "self-spec": (parent, dict(block_size=4, speculative=True))}
    for t in [float(x) for x in args.thresholds.split(",") if x]:
        modes[f"adapter-b4-t{t:g}"] = (adapted, dict(block_size=4, threshold=t, speculative=False))
        modes[f"parent-b4-t{t:g}"] = (parent, dict(block_size=4, threshold=t, speculative=False))
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for m, (llm, kw) in modes.items():  # warm-up (first-call allocations, thread pools), not timed
        bc.run_mode(llm, prompts[:1], SamplingParams.from_flat(**{**base, "max_tokens": 4}, **kw))
    for _ in range(args.repeats):  # interleaved repeats: load changes hit every mode alike
        for m, (llm, kw) in modes.items():
            runs[m].append(bc.run_mode(llm, prompts, SamplingParams.from_flat(**base, **kw)))
    ref = [o.token_ids for o in runs["parent-b1"][0]["outs"]]
    rows, summary = [], {}
    for m, rs in runs.items():
        outs = rs[0]["outs"]
        texts = [o.text for o in outs]
        checkable = [(t, p["answer"]) for t, p in zip(texts, prompts) if p.get("answer") is not None]
        acc = (sum(qm.exact_match(t, a) for t, a in checkable) / len(checkable)) if checkable else float("nan")
        s = {"tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in rs),
             "tpf": rs[0]["tokens"] / max(rs[0]["nfe"], 1), "tokens": rs[0]["tokens"],
             "identical_to_parent": sum(o.token_ids == r for o, r in zip(outs, ref)) / len(ref),
             "accuracy": acc, "n_checkable": len(checkable),
             "seconds": [round(r["seconds"], 3) for r in rs]}
        summary[m] = s
        rows.append([m, s["tokens_per_s"], s["tpf"], s["identical_to_parent"], s["accuracy"], s["tokens"]])
    b1 = summary["parent-b1"]["tokens_per_s"]
    for m, r in zip(summary, rows):
        summary[m]["speed_vs_parent_b1"] = summary[m]["tokens_per_s"] / b1
        r.insert(2, summary[m]["speed_vs_parent_b1"])
    data = {"settings": vars(args), "environment": bc.environment(args.threads), "modes": summary,
            "adapter": adapted.model.adapter,
            "samples": {m: [o.text for o in rs[0]["outs"]] for m, rs in runs.items()}}
    md = bc.markdown_table(["mode", "tokens/s (median)", "x parent b1", "TPF", "identical to parent",
                            "accuracy (exact)", "tokens"], rows)
    (bc.RESULTS / Path(args.out_name).parent).mkdir(parents=True, exist_ok=True)
    bc.write_results(args.out_name, data, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
