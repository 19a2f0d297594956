"""Attention over a lane whose KV blocks are several runs of storage (a shared prefix's blocks, then its own): the
ways to read them, timed on this CPU (issue 42, the paged KV pool; docs/design.md#decoding, "KV cache").

For one lane (GQA: 8 query heads over 2 KV heads of 64, float32 unless ``--dtype``), ``--cached`` keys split into
two runs (``--prefix`` tokens shared, the rest its own) and ``--rows`` query rows (a decoding block) that see every
key:

* ``one view`` - the lane in one run: one SDPA call on the view (the lower bound; what a lane without a shared
  prefix costs);
* ``gather`` - the runs joined into one tensor (``torch.cat``: a copy of the lane's keys and values) and one SDPA
  call: what the pool avoids;
* ``scores`` - :func:`unmask.engine.lane_attention.lane_attend`'s float32 path: each run's scores side by side,
  one softmax, each run's values weighted in place;
* ``flash + lse`` - one fused CPU SDPA call per run and the runs merged by log-sum-exp (the half-precision path,
  :func:`unmask.engine.lane_attention._merged_runs`);
* ``per block + lse`` - the same per 16-token block (what a block-at-a-time kernel does without a fused loop).

Medians of ``--repeats`` calls after warm-up; the machine is shared (load noted in the JSON), so read ratios.

    .venv/bin/python benchmarks/bench_paged_attention.py

Writes ``benchmarks/results/bench_paged_attention.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_paged_attention"


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def case(cached: int, prefix: int, rows: int, dtype: torch.dtype, repeats: int) -> dict:
    from unmask.engine.lane_attention import _merged_runs, lane_attend

    g = torch.Generator().manual_seed(0)
    Hkv, gqa, D = 2, 4, 64
    query = torch.randn(Hkv * gqa, rows, D, generator=g).to(dtype)
    storage_k = torch.randn(Hkv, 2 * cached, D, generator=g).to(dtype)  # the pool's storage: two far-apart runs
    storage_v = torch.randn(Hkv, 2 * cached, D, generator=g).to(dtype)
    own = cached - prefix
    runs = [(storage_k[:, :prefix], storage_v[:, :prefix]), (storage_k[:, cached:cached + own], storage_v[:, cached:cached + own])]
    one = [(storage_k[:, :cached], storage_v[:, :cached])]
    blocks = [(k[:, i:i + 16], v[:, i:i + 16]) for k, v in runs for i in range(0, k.shape[1], 16)]
    scale = D ** -0.5

    def gather():
        k = torch.cat([r[0] for r in runs], 1)
        v = torch.cat([r[1] for r in runs], 1)
        return F.scaled_dot_product_attention(query[None], k[None], v[None], scale=scale, enable_gqa=True)

    ways = {"one view": lambda: lane_attend(query, one, None, scale), "gather": gather,
            "scores": (lambda: lane_attend(query.float(), [(k.float(), v.float()) for k, v in runs], None, scale))
            if dtype != torch.float32 else (lambda: lane_attend(query, runs, None, scale)),
            "flash + lse": lambda: _merged_runs(query, runs, None, scale),
            "per block + lse": lambda: _merged_runs(query, blocks, None, scale)}
    if dtype != torch.float32:
        del ways["scores"]  # in half precision it rounds the scores (not what the engine runs)
    return {name: timed(fn, repeats) * 1e3 for name, fn in ways.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--prefix-share", type=float, default=0.75, help="the shared prefix's share of the keys")
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    dtype = getattr(torch, args.dtype)
    rows = []
    for cached in args.cached:
        for q in args.rows:
            prefix = int(cached * args.prefix_share) // 16 * 16
            ms = case(cached, prefix, q, dtype, args.repeats)
            rows.append({"cached": cached, "prefix": prefix, "rows": q, "ms": ms})
    data = {"command": "python benchmarks/bench_paged_attention.py " + " ".join(sys.argv[1:]), "dtype": args.dtype,
            "threads": 1, "load_average": os.getloadavg(), "rows": rows}
    names = list(rows[0]["ms"])
    lines = [f"# Attention over a lane in two runs of KV storage ({args.dtype}, 1 thread)\n",
             f"`{data['command']}`; load average {data['load_average'][0]:.1f}. Median ms per call (one layer, one "
             "lane: 8 query heads over 2 KV heads of 64); in brackets the ratio to `one view`.\n",
             "| cached keys (shared prefix) | query rows | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for r in rows:
        base = r["ms"]["one view"]
        cells = [f"{r['ms'][n]:.3f} ({r['ms'][n] / base:.2f}x)" for n in names]
        lines.append(f"| {r['cached']} ({r['prefix']}) | {r['rows']} | " + " | ".join(cells) + " |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    OUT.with_name(OUT.name + suffix).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    OUT.with_name(OUT.name + suffix).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
