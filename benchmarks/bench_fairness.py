"""Cost-based fairness on the default model with default options (issue 41; docs/design.md#admission-and-limits).

Starts ``unmask serve`` (the default model, 2 threads unless --threads), then for each of the largest admissible
requests of each shape - a request costs every step its rows plus ``SEQUENCE_ROWS`` per sequence and lane
(``unmask.engine.step_cost``), at most ``--max-step-rows``: one plain block, n 4, cfg_scale, a self-speculative draft
block - streams it and, once it is decoding, times the first token of three 4-token requests sent one after another
(their median); records the server's RSS growth over the heavy request until 10 s after them (then closes it: on a
shared 2-core machine a whole 128-token heavy request can take many minutes), and the latency of the 400 for a
request past the limit (median of 5). Writes
benchmarks/results/bench_fairness.json.

    .venv/bin/python benchmarks/bench_fairness.py [--threads 2] [--port 8765]

Targets: first token < 1.5 s, RSS growth < 500 MB, the 400 < 100 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from unmask.engine.limits import DEFAULT_MAX_STEP_ROWS
from unmask.engine.step_cost import SEQUENCE_ROWS

OUT = Path(__file__).parent / "results" / "bench_fairness.json"
LIMIT = DEFAULT_MAX_STEP_ROWS  # --max-step-rows' default, in row-equivalents
S = SEQUENCE_ROWS
SPEC = (LIMIT - S) // 5  # a draft block d costs d x (2 + 3 branches) rows + S
HEAVY = {f"block {LIMIT - S} x n 1": dict(block_size=LIMIT - S, n=1, speculative=False),
         f"block {(LIMIT - 4 * S) // 4} x n 4": dict(block_size=(LIMIT - 4 * S) // 4, n=4, speculative=False),
         f"block {(LIMIT - 2 * S) // 2} x cfg": dict(block_size=(LIMIT - 2 * S) // 2, n=1, cfg_scale=1.5,
                                                    speculative=False),
         f"speculative draft block {SPEC} x n 1": dict(block_size=SPEC, n=1, speculative=True)}
HEAVY_TOKENS = 128  # long enough to be decoding all through the light requests
LIGHT_REPEATS = 3  # light requests per heavy one, one after another: their median first token
REFUSALS = 5  # requests past the limit: the median of their answers' latency
RSS_SECONDS = 10  # the heavy request's RSS is sampled this long after the light requests, then it is closed


def _chat(base: str, body: dict, first: list, done: threading.Event | None = None, span: list | None = None,
          stop: threading.Event | None = None) -> None:
    """Stream one chat; ``first`` gets the seconds to its first token, ``span`` its start and end; ``stop`` set:
    close the stream at its next event (the server aborts the request)."""
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as c, c.stream("POST", base + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if stop is not None and stop.is_set():
                break
            if line.startswith("data: {") and not first:
                choices = json.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):  # the first token's text, not the role chunk
                    first.append(time.perf_counter() - t0)
            if line == "data: [DONE]":
                break
    if span is not None:
        span.extend([t0, time.perf_counter()])
    if done is not None:
        done.set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    load_start = list(os.getloadavg())
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "unmask.cli.main", "serve", "--port", str(args.port),
                             "--threads", str(args.threads)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        msg = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        light = dict(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, stream=True)
        warm: list = []
        _chat(base, light, warm)
        rss = psutil.Process(proc.pid)
        rows = {}
        for name, kw in HEAVY.items():
            before, peak, done = rss.memory_info().rss, [0], threading.Event()
            heavy = dict(model=model, messages=msg, max_tokens=HEAVY_TOKENS, stream=True, ignore_eos=True, **kw)
            heavy_first, span, stop = [], [], threading.Event()
            t = threading.Thread(target=_chat, args=(base, heavy, heavy_first, done, span, stop))
            t.start()
            while not heavy_first:  # the heavy request is decoding
                time.sleep(0.05)
            firsts, inside = [], []
            for _ in range(LIGHT_REPEATS):  # one after another, all while the heavy request decodes
                time.sleep(0.5)
                first: list = []
                light_span: list = []
                _chat(base, light, first, span=light_span)
                firsts.append(round(first[0], 3) if first else None)
                inside.append(not done.is_set())
                peak[0] = max(peak[0], rss.memory_info().rss)
            t_end = time.perf_counter() + RSS_SECONDS
            while not done.wait(0.2) and time.perf_counter() < t_end:
                peak[0] = max(peak[0], rss.memory_info().rss)
            stop.set()
            t.join()
            got = [f for f in firsts if f is not None]
            rows[name] = {"first_token_s": statistics.median(got) if len(got) == len(firsts) else None,
                          "first_token_all_s": firsts, "light_inside_heavy": all(inside),
                          "heavy_seconds_observed": round(span[1] - span[0], 1),
                          "rss_growth_mb": round((max(peak[0], rss.memory_info().rss) - before) / 2**20, 1)}
            print(name, rows[name], flush=True)
        over = dict(model=model, messages=msg, max_tokens=512, block_size=2 * LIMIT)
        times = []
        for _ in range(REFUSALS):  # the median of several: one answer on a shared machine is one sample of its load
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", json=over, timeout=60)
            times.append(time.perf_counter() - t0)
        refusal = {"status": r.status_code, "seconds": round(statistics.median(times), 4),
                   "all_seconds": [round(x, 4) for x in times],
                   "param": r.json()["error"].get("param"), "message": r.json()["error"]["message"]}
        print("over the limit", refusal, flush=True)
        result = {"model": model, "threads": args.threads, "max_step_rows": LIMIT, "sequence_rows": S, "cpu_count": os.cpu_count(),
                  "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()), "heavy_tokens": HEAVY_TOKENS,
                  "heavy": rows, "over_limit": refusal,
                  "pass": all(v["first_token_s"] is not None and v["first_token_s"] < 1.5 and v["rss_growth_mb"] < 500
                              and v["light_inside_heavy"]
                              for v in rows.values()) and r.status_code == 400 and refusal["seconds"] < 0.1}
        OUT.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
