"""Concurrent streams through the HTTP server (issue 6, benchmark 4; target: 16 streams >= 3x one stream).

Starts ``unmask serve`` on the real 135M model in a subprocess (one intra-op thread unless ``--threads``), then for
each concurrency c sends c streaming chat completions at once (``stream: true``, ``include_usage``), block 32, one
token per step, greedy, ``ignore_eos`` (every request generates exactly ``--max-tokens`` tokens), distinct prompts.
Per wave: aggregate tokens/s = all completion tokens / wall time from the first request sent to the last ``[DONE]``;
TTFT = time to the first chunk with content; latency = time to ``[DONE]``; p50/p99 over all requests of all waves.

    .venv/bin/python benchmarks/bench_concurrency.py --levels 1,4,16,32 --max-tokens 32 --waves 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

import bench_common as bc

TOPICS = ["the sea", "a cat", "winter", "music", "a city", "trees", "the moon", "bread", "rain", "a friend",
          "mountains", "a library", "coffee", "trains", "a garden", "birds"]


async def one_request(client, url, body):
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices", []):
                if ch.get("delta", {}).get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "tokens": tokens}


async def wave(base, model, c, args, wave_idx):
    import httpx

    bodies = [{"model": model, "stream": True, "stream_options": {"include_usage": True},
               "messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[(i + wave_idx) % len(TOPICS)]}."}],
               "max_tokens": args.max_tokens, "steps": args.max_tokens, "temperature": 0,
               "block_size": args.block_size, "ignore_eos": True,
               "seed": i} for i in range(c)]
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one_request(client, base + "/v1/chat/completions", b) for b in bodies])
        wall = time.perf_counter() - t0
    return wall, results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--waves", type=int, default=1, help="waves per concurrency level")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of the server process")
    args = ap.parse_args(argv)
    model_path = args.model
    if model_path is None:
        from unmask.training.realmodel import ensure_default_converted

        model_path = str(ensure_default_converted(block_size=args.block_size, out=bc.DEFAULT_MODEL))
    levels = [int(x) for x in args.levels.split(",")]
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_concurrency_server_{os.getpid()}.log")
    server, base = bc.start_server([model_path, "--max-batch-size", str(max(levels)), "--served-model-name", "bench",
                                    "--log-level", "warning"], args.threads, log_path)
    try:
        environment = bc.environment(args.threads)
        environment["server_threads"] = args.threads
        asyncio.run(wave(base, "bench", 1, argparse.Namespace(max_tokens=4, block_size=args.block_size), 0))  # warm
        results = []
        for c in levels:
            walls, reqs = [], []
            for w in range(args.waves):
                wall, rs = asyncio.run(wave(base, "bench", c, args, w))
                walls.append(wall)
                reqs += rs
                for r in rs:
                    r["wave_tokens_per_s"] = sum(x["tokens"] for x in rs) / wall
            agg = bc.median([sum(r["tokens"] for r in reqs[i * c:(i + 1) * c]) / walls[i] for i in range(len(walls))])
            ttft = [r["ttft"] for r in reqs if r["ttft"] is not None]
            lat = [r["latency"] for r in reqs]
            res = {"concurrency": c, "waves": args.waves, "wall_seconds": walls, "aggregate_tokens_per_s": agg,
                   "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
                   "latency_p50": float(np.percentile(lat, 50)), "latency_p99": float(np.percentile(lat, 99)),
                   "requests": reqs}
            results.append(res)
            print(c, {k: v for k, v in res.items() if k != "requests"}, flush=True)
    finally:
        bc.stop_server(server)
    one = results[0]["aggregate_tokens_per_s"] if levels[0] == 1 else None
    for r in results:
        r["vs_one_stream"] = r["aggregate_tokens_per_s"] / one if one else None
    data = {"benchmark": "concurrency",
            "settings": {"model": model_path, "levels": levels, "max_tokens": args.max_tokens,
                         "block_size": args.block_size, "steps": "one token per step", "temperature": 0,
                         "ignore_eos": True, "cache": "auto (exact)", "waves": args.waves,
                         "server": f"unmask serve --max-batch-size {max(levels)}, OMP_NUM_THREADS={args.threads}",
                         "client": "httpx, streaming chat completions, all requests of a wave sent at once"},
            "environment": environment, "results": results}
    rows = [[r["concurrency"], r["aggregate_tokens_per_s"],
             "" if r["vs_one_stream"] is None else f"{r['vs_one_stream']:.2f}x",
             r["ttft_p50"], r["ttft_p99"], r["latency_p50"], r["latency_p99"]] for r in results]
    md = (f"Concurrent streaming chat completions through `unmask serve` ({model_path}), {args.max_tokens} tokens "
          f"each, block {args.block_size}, one token per step, greedy, exact cache, {args.waves} wave(s) per level.\n\n"
          + bc.markdown_table(["streams", "aggregate tokens/s", "vs 1 stream", "TTFT p50 (s)", "TTFT p99 (s)",
                               "latency p50 (s)", "latency p99 (s)"], rows))

    def plot(path):
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
        a1.plot(levels, [r["aggregate_tokens_per_s"] for r in results], "o-")
        a1.set_xlabel("concurrent streams")
        a1.set_ylabel("aggregate tokens/s")
        a2.plot(levels, [r["ttft_p50"] for r in results], "o-", label="TTFT p50")
        a2.plot(levels, [r["latency_p50"] for r in results], "o-", label="latency p50")
        a2.set_xlabel("concurrent streams")
        a2.set_ylabel("seconds")
        a2.legend()
        bc.save_figure(fig, path)

    return bc.report(bc.result_name("bench_concurrency", args.block_size), data, md, plot)


if __name__ == "__main__":
    raise SystemExit(main())
