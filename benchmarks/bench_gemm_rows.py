"""Where the exact-cache speedup is bounded on a CPU: matmul throughput against the number of rows forwarded.

The exact KV cache (issue 6, benchmark 1) replaces a no-cache step, which forwards every committed token plus the
active block (prompt + generated so far + 32 rows: ~190 rows on average over a 256-token generation after a
48-token prompt), by a step that forwards the 32 rows of the active block. If a forward cost were proportional to
its rows, the speedup would be ~6x; on a CPU a 32-row matrix product runs at a lower FLOP rate than a 190-row one
(weights streamed from memory for fewer rows, smaller GEMM tiles), so the bound is lower. This benchmark measures
exactly that, with the real model's linear-layer shapes (SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64,
MLP 1536, 30 layers) and distinct weights per layer (so they do not stay in cache between layers as they would in
a one-layer loop).

    .venv/bin/python benchmarks/bench_gemm_rows.py --threads 2 --rows 32,64,128,192 --repeats 7

Output: ``results/bench_gemm_rows.json`` / ``.md``: milliseconds per 30-layer pass of the seven linear layers
(median of ``--repeats``), GFLOP/s, and the time ratio of each row count to the smallest.
"""
from __future__ import annotations

import argparse
import time

import bench_common as bc

HIDDEN, KV, MLP, LAYERS = 576, 192, 1536, 30
# (out_features, in_features) of q, k, v, o, gate, up, down
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="32,64,128,192", help="comma-separated row counts (tokens per forward)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    import torch
    import torch.nn.functional as F

    rows = [int(r) for r in args.rows.split(",")]
    env = bc.environment(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=g) for o, i in SHAPES] for _ in range(LAYERS)]
    flops_per_row = 2 * LAYERS * sum(o * i for o, i in SHAPES)
    results = []
    for m in rows:
        x_h, x_m = torch.randn(m, HIDDEN, generator=g), torch.randn(m, MLP, generator=g)

        def one_pass():
            for layer in weights:
                for w in layer:
                    F.linear(x_h if w.shape[1] == HIDDEN else x_m, w)

        one_pass()  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - t0)
        ms = bc.median(times) * 1e3
        results.append({"rows": m, "ms_median": ms, "ms_all": [t * 1e3 for t in times],
                        "gflops": flops_per_row * m / (ms / 1e3) / 1e9})
    base = results[0]
    for r in results:
        r["time_vs_smallest"] = r["ms_median"] / base["ms_median"]
        r["rows_vs_smallest"] = r["rows"] / base["rows"]
    header = ["rows per forward", "ms per 30-layer pass (median)", "GFLOP/s", "time x smallest", "rows x smallest"]
    table = bc.markdown_table(header, [[r["rows"], r["ms_median"], r["gflops"], r["time_vs_smallest"],
                                        r["rows_vs_smallest"]] for r in results])
    md = ("The seven linear layers of SmolLM2-135M x 30 layers (distinct weights per layer), float32, "
          f"{args.repeats} repeats. A cached step forwards 32 rows; a no-cache step over a 256-token generation "
          "~190 on average: the cache's speedup on this machine is bounded by the time ratio between those rows, "
          "not by the row ratio.\n\n" + table)
    bc.write_results("bench_gemm_rows", {"settings": vars(args), "environment": env, "runs": results}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
