"""Continuous batching with a refilled queue: planned forwards against one padded forward per step (issue 6).

More requests than batch slots go through one :class:`~unmask.engine.scheduler.Scheduler`; answers end at EOS at
different steps, so waiting requests join the running batch throughout and their prompt prefill shares a step
with the others' decoding. Two ways to run such a step, alternated within the same run:

* ``planned``: the denoiser's default - the step's sequences are split into the forwards that minimise padded
  rows (:func:`unmask.engine.denoiser.plan_forwards`), e.g. the joiner's prefill apart from the one-row steps;
* ``padded``: every step is one ``[B, Q]`` forward, all rows padded to the longest chunk (the engine before the
  plan; ``forward_overhead_rows`` set so high that the plan never splits).

Both produce the same tokens (checked). Reported per mode: aggregate generated tokens/s (median of repeats),
forwards, and the ratio. Prompts: the first N training prompts of ``benchmarks/data``, chat template, greedy.

    .venv/bin/python benchmarks/bench_continuous.py --model CKPT --prompts 64 --batch 16 --block-size 1 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import bench_common as bc

DATA = Path(__file__).resolve().parent / "data" / "train_prompts.jsonl"
NEVER_SPLIT = 10 ** 9


def run_once(llm, prompt_ids, params, batch: int, overhead_rows: int) -> dict:
    """Decode every prompt through one scheduler; returns tokens, seconds, forwards and the outputs."""
    from unmask.engine.scheduler import Scheduler

    den = llm.denoiser
    saved = den.forward_overhead_rows
    den.forward_overhead_rows = overhead_rows
    try:
        sched = Scheduler(den, max_batch_size=batch)
        seqs = [llm.make_sequences(ids, params, f"c{i}")[0] for i, ids in enumerate(prompt_ids)]
        for s in seqs:
            sched.add(s)
        f0, t0 = den.forwards, time.perf_counter()
        while sched.has_work():
            sched.step()
        seconds = time.perf_counter() - t0
    finally:
        den.forward_overhead_rows = saved
    outs = [list(s.output_ids) for s in seqs]
    return {"tokens": sum(map(len, outs)), "seconds": seconds, "forwards": den.forwards - f0, "outputs": outs}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write ``results/bench_continuous.{json,md}``; returns 0 (1 if the two modes' tokens differ)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="servable checkpoint (default: the converted SmolLM2)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="max_batch_size (fewer than --prompts: the queue refills)")
    ap.add_argument("--block-size", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = bc.parse_args(ap, argv, threads=2)
    from unmask.engine import LLM, SamplingParams

    llm = LLM(bc.real_model(args.model, weights=args.weights), max_batch_size=args.batch)
    prompts = [json.loads(line)["prompt"] for line in DATA.open()][: args.prompts]
    prompt_ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, block_size=args.block_size,
                            speculative=False)
    env = bc.environment(args.threads)
    run_once(llm, prompt_ids[: min(4, len(prompt_ids))], params, args.batch, llm.denoiser.forward_overhead_rows)
    modes = {"planned": llm.denoiser.forward_overhead_rows, "padded": NEVER_SPLIT}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, rows in modes.items():  # alternated, so drifting machine load hits both
            runs[mode].append(run_once(llm, prompt_ids, params, args.batch, rows))
    same = all(r["outputs"] == runs["planned"][0]["outputs"] for rs in runs.values() for r in rs)
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {"tokens_per_s": bc.median([r["tokens"] / r["seconds"] for r in rs]),
                         "seconds": bc.median([r["seconds"] for r in rs]),
                         "tokens": rs[0]["tokens"], "forwards": rs[0]["forwards"]}
    ratio = summary["planned"]["tokens_per_s"] / summary["padded"]["tokens_per_s"]
    rows = [[m, s["tokens"], s["forwards"], s["seconds"], s["tokens_per_s"],
             f"{s['tokens_per_s'] / summary['padded']['tokens_per_s']:.2f}x"] for m, s in summary.items()]
    data = {"settings": vars(args), "environment": env, "summary": summary, "ratio_planned_vs_padded": ratio,
            "same_tokens": same,
            "runs": {m: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for m, rs in runs.items()}}
    md = (f"Continuous batching, {args.prompts} chat prompts through one scheduler of {args.batch} slots, block "
          f"{args.block_size}, greedy, <= {args.max_tokens} tokens, {args.repeats} repeats alternated (median). "
          f"planned = the step's sequences split into the forwards minimising padded rows (the engine's default); "
          f"padded = one forward per step, every row padded to the longest chunk. Same tokens in both modes: "
          f"{same}.\n\n"
          + bc.markdown_table(["mode", "tokens", "forwards", "seconds", "tokens/s", "vs padded"], rows))
    print(md)
    bc.write_results(bc.result_name("bench_continuous"), data, md)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
