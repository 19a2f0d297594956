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

``--formats fp32,fp16,int8`` also times the same layers with fbgemm's packed weights (``torch.ao`` dynamic
linears: fp16 weights with float32 activations and accumulation, or int8 weights with per-tensor dynamically
quantized activations) - the kernels behind ``unmask serve --weights fp16``, against MKL's float32 GEMM.

    .venv/bin/python benchmarks/bench_gemm_rows.py --threads 2 --rows 1,2,4,8,16,20,32 --formats fp32,fp16,int8

Output: ``results/bench_gemm_rows.json`` / ``.md`` (a rerun overwrites them): milliseconds per 30-layer
pass of the seven linear layers (median of ``--repeats``), GFLOP/s, and the time ratio of each row count to the
smallest of the same format.
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
    ap.add_argument("--formats", default="fp32", help="comma-separated: fp32 (MKL), fp16 / int8 (fbgemm packed)")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - {"fp32", "fp16", "int8"})
    if unknown:
        ap.error(f"--formats: unknown {unknown}; choose from fp32, fp16, int8")
    bc.set_threads(args.threads)
    import torch
    import torch.nn.functional as F

    rows = [int(r) for r in args.rows.split(",")]
    env = bc.environment(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=g) for o, i in SHAPES] for _ in range(LAYERS)]
    flops_per_row = 2 * LAYERS * sum(o * i for o, i in SHAPES)

    def layer_fns(fmt):
        """Per layer, per shape: a callable x -> x @ W^T in format ``fmt``."""
        if fmt == "fp32":
            return [[(lambda x, w=w: F.linear(x, w)) for w in layer] for layer in weights]
        import warnings

        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        dtype = torch.float16 if fmt == "fp16" else torch.qint8
        out = []
        for layer in weights:
            mods = []
            for w in layer:
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data = w
                if dtype == torch.qint8:
                    lin.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
                else:
                    lin.qconfig = torch.ao.quantization.float16_dynamic_qconfig
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mods.append(DynamicLinear.from_float(lin))
            out.append(mods)
        return out

    results = []
    for fmt in formats:
        fns = layer_fns(fmt)
        with torch.inference_mode():
            for m in rows:
                x_h, x_m = torch.randn(m, HIDDEN, generator=g), torch.randn(m, MLP, generator=g)

                def one_pass():
                    for layer, shapes in zip(fns, [SHAPES] * LAYERS):
                        for fn, (_, inp) in zip(layer, shapes):
                            fn(x_h if inp == HIDDEN else x_m)

                one_pass()  # warm-up
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    one_pass()
                    times.append(time.perf_counter() - t0)
                ms = bc.median(times) * 1e3
                results.append({"format": fmt, "rows": m, "ms_median": ms, "ms_all": [t * 1e3 for t in times],
                                "gflops": flops_per_row * m / (ms / 1e3) / 1e9})
    fp32_ms = {r["rows"]: r["ms_median"] for r in results if r["format"] == "fp32"}
    for r in results:
        base = next(b for b in results if b["format"] == r["format"])
        r["time_vs_smallest"] = r["ms_median"] / base["ms_median"]
        r["rows_vs_smallest"] = r["rows"] / base["rows"]
        r["speedup_vs_fp32"] = fp32_ms[r["rows"]] / r["ms_median"] if r["rows"] in fp32_ms else None
    header = ["format", "rows per forward", "ms per 30-layer pass (median)", "GFLOP/s", "time x smallest",
              "rows x smallest", "speed-up vs fp32"]
    table = bc.markdown_table(header, [[r["format"], r["rows"], r["ms_median"], r["gflops"], r["time_vs_smallest"],
                                        r["rows_vs_smallest"], r["speedup_vs_fp32"] or "-"] for r in results])
    md = ("The seven linear layers of SmolLM2-135M x 30 layers (distinct weights per layer), "
          f"{args.repeats} repeats. fp32 = MKL float32 GEMM; fp16 / int8 = fbgemm packed weights (torch.ao dynamic "
          "linears). A cached step forwards 32 rows; a no-cache step over a 256-token generation "
          "~190 on average: the cache's speedup on this machine is bounded by the time ratio between those rows, "
          "not by the row ratio.\n\n" + table)
    bc.write_results(bc.result_name("bench_gemm_rows"), {"settings": vars(args), "environment": env, "runs": results}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
