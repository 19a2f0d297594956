"""What a denoising step costs per row and per sequence on the served default model: the step cost model of
``--max-step-rows`` (docs/design.md#admission-and-limits, issue 41).

Runs the engine in-process on the default model with the default options (its weights and format, no step bound,
no prefix cache) and, for each configuration ``n sequences x block rows``, times decoding steps (the prompts' prefill
done, the least of ``--steps`` rounds: on a shared machine the least-interfered step), then fits ``step seconds = a + b x rows + c x sequences`` by least squares. The
per-sequence term in row-equivalents is ``c / b`` (what a sequence costs beyond its rows: its own attention over
its own cache, its KV appends, its sampling, its bookkeeping); ``engine/step_cost.py`` states the value the
scheduler uses and cites this result.

    .venv/bin/python benchmarks/bench_step_cost.py --threads 2 --steps 5

Output: ``results/bench_step_cost.json`` / ``.md``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import bench_common as bc

#: plain diffusion (sequences, block rows): the same 64 rows in 1-8 sequences, and 1 sequence at 32 and 128 rows
CONFIGS = [(1, 64), (2, 32), (4, 16), (8, 8), (1, 32), (1, 128)]
#: self-speculative at an explicit draft block (what the scheduler counts as draft_block x (2 + branches) rows)
SPECULATIVE = [(1, 8)]


def start(model, tokenizer, n: int, block: int, speculative: bool):
    """An engine of its own (the shared model, no step bound, no prefix cache) decoding one request of ``n`` choices
    at ``block`` rows each (plain diffusion; ``speculative``: self-speculative at draft block ``block``), its
    prefill and first steps done."""
    from unmask.engine.engine import Engine
    from unmask.engine.options import EngineConfig
    from unmask.engine.params import SamplingParams

    engine = Engine(model, EngineConfig(max_step_rows=None, enable_prefix_caching=False, max_batch_size=16))
    ids = tokenizer.encode("Write a long story about a lighthouse keeper.")
    params = SamplingParams(max_tokens=256, block_size=block, ignore_eos=True, temperature=0.0,
                            speculative=speculative)
    reqs = engine.add_request(ids, params, "r", n=n)
    while not all(r.nfe for r in reqs):
        engine.step()
    engine.step()
    return engine, reqs


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares ``t = a + b rows + c seqs`` over ``(seqs, rows_per_seq, t)``."""
    import numpy as np

    X = np.array([[1.0, s * r, s] for s, r, _ in points])
    y = np.array([t for *_, t in points])
    a, b, c = np.linalg.lstsq(X, y, rcond=None)[0]
    return float(a), float(b), float(c)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from unmask.cli.serve import default_model
    from unmask.engine import load_model
    from unmask.engine.options import EngineConfig
    from unmask.engine.step_cost import step_rows

    path, _, described = default_model()
    model = load_model(path, **EngineConfig().load_options())
    tokenizer = model.tokenizer
    runs = [(n, b, False) for n, b in CONFIGS] + [(n, b, True) for n, b in SPECULATIVE]
    engines = [start(model, tokenizer, n, b, spec) for n, b, spec in runs]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(args.steps):  # round robin: a shared machine's load falls on every configuration alike
        for (engine, _), ts in zip(engines, times):
            t0 = time.perf_counter()
            engine.step()
            ts.append(time.perf_counter() - t0)
        print("round", [round(ts[-1], 3) for ts in times], flush=True)
    rows, spec = [], []
    for (n, block, speculative), (_, reqs), ts in zip(runs, engines, times):
        t = min(ts)  # the least-interfered step: on a shared machine the median still carries others' load
        if speculative:
            spec.append({"sequences": n, "draft_block": block, "rows_counted": n * step_rows(reqs[0]),
                         "step_s": round(t, 4), "median_s": round(statistics.median(ts), 4),
                         "all_s": [round(x, 4) for x in ts]})
        else:
            rows.append({"sequences": n, "block": block, "rows": n * block, "step_s": round(t, 4),
                         "median_s": round(statistics.median(ts), 4), "all_s": [round(x, 4) for x in ts]})
        print((spec if speculative else rows)[-1], flush=True)
    a, b, c = fit([(r["sequences"], r["block"], r["step_s"]) for r in rows])
    per_seq_rows = c / b
    data = {"model": described, "threads": args.threads, "steps": args.steps, "environment": bc.environment(args.threads),
            "configs": rows, "speculative": spec, "fit": {"fixed_s": round(a, 4), "per_row_s": round(b, 5), "per_sequence_s": round(c, 4),
                                     "per_sequence_rows": round(per_seq_rows, 1)}}
    md = ["| sequences | block | rows | step (s, least of the rounds) | median (s) | fit (s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['sequences']} | {r['block']} | {r['rows']} | {r['step_s']:.3f} | {r['median_s']:.3f} | "
                  f"{a + b * r['rows'] + c * r['sequences']:.3f} |")
    md += ["", "| speculative: sequences | draft block | rows counted | step (s, least of the rounds) | median (s) | fit (s) |",
           "|---|---|---|---|---|---|"]
    for r in spec:
        md.append(f"| {r['sequences']} | {r['draft_block']} | {r['rows_counted']} | {r['step_s']:.3f} | "
                  f"{r['median_s']:.3f} | "
                  f"{a + b * r['rows_counted'] + c * r['sequences']:.3f} |")
    md += ["", f"Fit on the least of the rounds: {a:.3f} s + {b * 1000:.2f} ms x rows + {c * 1000:.1f} ms x sequences: "
               f"one sequence costs ~{per_seq_rows:.0f} rows beyond its own."]
    return bc.report("bench_step_cost", data, "\n".join(md) + "\n")


if __name__ == "__main__":
    bc.run_script(main)
