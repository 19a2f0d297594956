"""Does the served default's resident memory grow without bound? N identical rounds of a fixed mixed workload of
long prompts against ``unmask serve``, with the server's RSS read after each round once it is idle.

What it does:

1. starts ``unmask serve`` (no MODEL: the default, int4 weights on a CPU; ``--serve-arg`` adds options) on a free
   loopback port with ``--threads`` torch threads (``--env KEY=VALUE`` adds to the server's environment, e.g.
   ``MALLOC_ARENA_MAX=2`` as a diagnostic);
2. runs ``--rounds`` rounds; every round sends the same mix (the texts differ per round, the token counts do not):

   * 4 concurrent streamed chats, prompts of 1500, 2000, 2500 and 3000 tokens of varied text (consecutive rows
     of ``benchmarks/data/{eval,train}_prompts.jsonl`` from an offset that moves each round), two greedy (the
     default: the parent's exact answers) and two in plain diffusion (block 4, threshold 0.5; block 2 with
     ``steps``), one greedy with the denoising stream;
   * beside them, one after another: 8 short requests (chat and completions; greedy, seeded sampling, diffusion),
     1 request with ``n: 2`` (seeded sampling), 2 streamed chats of 1200 tokens that the client leaves after the
     third chunk (a disconnect mid-stream), 1 plain request of 2000 tokens given up after 1.5 s (a disconnect
     during prefill: the server aborts it) and the second turn of the first long chat (its prompt + answer +
     a question: a prefix-cache hit while the store still holds that prompt; the default 4096-token store
     evicts it under a round's 17,700 prompt tokens);
3. after each round waits until ``/health`` shows nothing running or waiting, then ``--settle`` seconds, and reads
   ``/proc/PID/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ``Threads``), the open file descriptors,
   ``/health`` (``prefix_cache``: tokens held, queries, hits, evicted) and the prefix-cache counters of
   ``/metrics``;
4. writes ``benchmarks/results/<--name>.{json,md}`` (default ``bench_rss_soak``): the per-round series and the
   verdict: RSS growth from the reading after round ``--warmup`` to the last one, in MB and in MB per round (least
   squares over those readings, and over their second half). MB = 10**6 bytes.

Exit status 0 when every normal request succeeded (disconnects aside) and the post-warm-up slope is below
``--max-slope-mb`` MB per round (default 5), else 1.

Run (about a minute a round on 2 shared cores; loopback only, nothing else is contacted):

    .venv/bin/python benchmarks/bench_rss_soak.py --rounds 20 --threads 2

A diagnostic run with another allocator setting: ``--env MALLOC_ARENA_MAX=2 --name bench_rss_soak_arena2``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

LONG_TOKENS = (1500, 2000, 2500, 3000)
DISCONNECT_TOKENS = 1200
ABORT_TOKENS = 2000
STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
QUESTION = "\n\nSummarize the text above in three sentences."


class Texts:
    """Prompt texts of exact token counts: consecutive rows of ``eval_prompts.jsonl`` + ``train_prompts.jsonl``
    (instructions, questions, code and prose) from a moving offset, cut at the wanted token count by the served
    model's tokenizer."""

    def __init__(self, tokenizer_dir: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.rows = [json.loads(x)["prompt"] for name in ("eval_prompts.jsonl", "train_prompts.jsonl")
                     for x in (bc.DATA / name).read_text().splitlines() if x.strip()]
        self.pos = 0

    def take(self, tokens: int) -> str:
        """The next ``tokens`` tokens of text (wrapping around the rows)."""
        ids: list[int] = []
        while len(ids) < tokens:
            ids += self.tok.encode(self.rows[self.pos % len(self.rows)] + "\n\n", add_special_tokens=False)
            self.pos += 1
        return self.tok.decode(ids[:tokens])


def proc_figures(pid: int) -> dict:
    """``/proc/PID/status`` memory fields in MB, the thread count and the open file descriptors."""
    out = {f: round(bc.proc_status_kib(pid, f) * 1024 / 1e6, 1) for f in STATUS_FIELDS}
    status = Path(f"/proc/{pid}/status").read_text()
    out["threads"] = int(next(x.split()[1] for x in status.splitlines() if x.startswith("Threads:")))
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def prometheus_values(text: str, names: tuple[str, ...]) -> dict:
    """Sum of each named metric's samples in a Prometheus text exposition."""
    out = {n: 0.0 for n in names}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


async def stream_chat(client, model: str, messages: list, body: dict, leave_after: int = 0) -> dict:
    """One streamed chat; ``leave_after`` > 0: close the connection after that many ``data:`` chunks."""
    text, chunks, done = [], 0, False
    async with client.stream("POST", "/v1/chat/completions",
                             json={"model": model, "messages": messages, "stream": True, **body}) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": (await r.aread()).decode()[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunks += 1
            if line == "data: [DONE]":
                done = True
                break
            if leave_after and chunks >= leave_after:
                return {"ok": True, "left": True, "chunks": chunks}
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                text.append((c.get("delta") or {}).get("content") or "")
    return {"ok": done, "chunks": chunks, "text": "".join(text)}


async def plain(client, route: str, body: dict, timeout: float | None = None) -> dict:
    try:
        r = await client.post(route, json=body, timeout=timeout or client.timeout)
    except httpx.TimeoutException:
        return {"ok": True, "left": True}
    ok = r.status_code == 200 and all(c.get("finish_reason") for c in r.json().get("choices", [{}]))
    return {"ok": ok, "status": r.status_code, "n": len(r.json().get("choices", [])) if ok else 0,
            "error": None if ok else r.text[:300]}


GREEDY = {"temperature": 0}
DIFFUSION_T = {"block_size": 4, "threshold": 0.5}
DIFFUSION_S = {"block_size": 2, "steps": 24}


async def one_round(client, model: str, texts: Texts, max_tokens: int) -> dict:
    """The round's requests (module docstring); returns per-kind outcomes."""
    longs = [texts.take(n) for n in LONG_TOKENS]
    cut = [texts.take(DISCONNECT_TOKENS) for _ in range(2)]
    abort_text = texts.take(ABORT_TOKENS)
    short = [texts.take(40 + 20 * i) for i in range(8)]
    settings = [GREEDY, {**GREEDY, "stream_options": {"include_denoising": True}}, DIFFUSION_T, DIFFUSION_S]
    long_msgs = [[{"role": "user", "content": t + QUESTION}] for t in longs]
    long_tasks = [asyncio.create_task(stream_chat(client, model, m, {"max_tokens": max_tokens, **s}))
                  for m, s in zip(long_msgs, settings)]

    async def side() -> list[tuple[str, dict]]:
        out = []
        for i, t in enumerate(short):
            if i % 2:
                body = {"model": model, "prompt": t, "max_tokens": 16, **(GREEDY if i % 4 == 1 else DIFFUSION_T)}
                out.append(("short_completion", await plain(client, "/v1/completions", body)))
            else:
                s = GREEDY if i == 0 else {"temperature": 0.8, "seed": i} if i == 2 else DIFFUSION_S
                body = {"model": model, "messages": [{"role": "user", "content": t}], "max_tokens": 24, **s}
                out.append(("short_chat", await plain(client, "/v1/chat/completions", body)))
            if i == 3:
                out.append(("disconnect_stream", await stream_chat(
                    client, model, [{"role": "user", "content": cut[0] + QUESTION}],
                    {"max_tokens": max_tokens, **DIFFUSION_T}, leave_after=3)))
            if i == 5:
                out.append(("disconnect_prefill", await plain(client, "/v1/chat/completions", {
                    "model": model, "messages": [{"role": "user", "content": abort_text + QUESTION}],
                    "max_tokens": max_tokens}, timeout=1.5)))
        out.append(("n2", await plain(client, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": short[1]}], "max_tokens": 24, "n": 2,
            "temperature": 0.7, "seed": 5})))
        out.append(("disconnect_stream", await stream_chat(
            client, model, [{"role": "user", "content": cut[1] + QUESTION}], {"max_tokens": max_tokens, **GREEDY},
            leave_after=3)))
        return out

    side_out = await side()
    long_out = await asyncio.gather(*long_tasks)
    first = long_out[0]
    turn2 = await stream_chat(client, model, long_msgs[0] + [
        {"role": "assistant", "content": first.get("text", "")}, {"role": "user", "content": "Now in one sentence."}],
        {"max_tokens": 16, **GREEDY})
    results = [("long_stream", o) for o in long_out] + side_out + [("second_turn", turn2)]
    summary: dict[str, dict] = {}
    for kind, o in results:
        s = summary.setdefault(kind, {"sent": 0, "ok": 0, "left": 0, "errors": []})
        s["sent"] += 1
        s["ok"] += bool(o.get("ok"))
        s["left"] += bool(o.get("left"))
        if not o.get("ok"):
            s["errors"].append(o.get("error") or o.get("status"))
    return summary


async def wait_idle(client, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while True:
        h = (await client.get("/health", timeout=30)).json()
        if (h.get("running", 0) == 0 and h.get("waiting", 0) == 0) or time.time() > deadline:
            return h
        await asyncio.sleep(1)


async def soak(args, base: str, pid: int, model: str, texts: Texts) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=900,
                                 limits=httpx.Limits(max_connections=16)) as client:
        await asyncio.sleep(args.settle)
        h = await wait_idle(client)
        rows.append({"round": 0, "seconds": 0.0, **proc_figures(pid), "prefix_cache": h.get("prefix_cache"),
                     "requests": {}})
        print(json.dumps(rows[-1]), flush=True)
        for rnd in range(1, args.rounds + 1):
            texts.pos = (rnd - 1) * args.rows_per_round  # each round its own text, the same token counts
            t0 = time.perf_counter()
            outcome = await one_round(client, model, texts, args.max_tokens)
            h = await wait_idle(client)
            secs = time.perf_counter() - t0
            await asyncio.sleep(args.settle)
            h = (await client.get("/health", timeout=30)).json()
            prom = prometheus_values((await client.get("/metrics", timeout=30)).text,
                                     ("unmask:prefix_cache_queries_total", "unmask:prefix_cache_hits_total",
                                      "unmask:num_requests_running", "unmask:num_requests_waiting"))
            rows.append({"round": rnd, "seconds": round(secs, 1), **proc_figures(pid),
                         "prefix_cache": h.get("prefix_cache"), "metrics": prom, "requests": outcome})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "requests"}), flush=True)
    return rows


def slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def verdict(rows: list[dict], warmup: int) -> dict:
    after = [r for r in rows if r["round"] >= max(1, warmup)]
    xs, ys = [r["round"] for r in after], [r["VmRSS"] for r in after]
    half = len(after) // 2
    return {"warmup_rounds": warmup, "rss_start_mb": rows[0]["VmRSS"], "rss_after_warmup_mb": ys[0] if ys else None,
            "rss_last_mb": rows[-1]["VmRSS"], "rss_max_after_warmup_mb": max(ys) if ys else None,
            "growth_after_warmup_mb": round(ys[-1] - ys[0], 1) if ys else None,
            "slope_mb_per_round": round(slope(xs, ys), 2),
            "slope_second_half_mb_per_round": round(slope(xs[half:], ys[half:]), 2),
            "hwm_last_mb": rows[-1]["VmHWM"]}


def markdown(data: dict) -> str:
    v, s = data["verdict"], data["settings"]
    rows = [[r["round"], r["seconds"], r["VmRSS"], r["VmHWM"], r["RssAnon"], r["RssFile"],
             (r["prefix_cache"] or {}).get("tokens", ""), (r["prefix_cache"] or {}).get("hits", ""),
             (r["prefix_cache"] or {}).get("evicted", ""), r["threads"], r["fds"],
             sum(k["sent"] - k["ok"] for k in r["requests"].values())] for r in data["rounds"]]
    per = ", ".join(f"{k} {n}" for k, n in data["requests_per_round"].items())
    return (f"Served: `unmask serve {' '.join(s['serve_args'])}` with {s['threads']} threads"
            f"{', env ' + ' '.join(s['env']) if s['env'] else ''}; {s['rounds']} rounds, each: {per} "
            f"(long prompts {', '.join(map(str, LONG_TOKENS))} tokens, max_tokens {s['max_tokens']}); figures read "
            f"{s['settle']} s after the server is idle. MB = 10^6 bytes.\n\n"
            f"RSS {v['rss_start_mb']} MB loaded, {v['rss_after_warmup_mb']} MB after round {max(1, v['warmup_rounds'])}"
            f", {v['rss_last_mb']} MB after round {s['rounds']} (max {v['rss_max_after_warmup_mb']}): "
            f"{v['growth_after_warmup_mb']:+} MB after the warm-up, slope {v['slope_mb_per_round']:+} MB/round "
            f"({v['slope_second_half_mb_per_round']:+} MB/round over the second half); peak (VmHWM) "
            f"{v['hwm_last_mb']} MB. Failed requests: {data['failed_requests']}.\n\n"
            + bc.markdown_table(["round", "s", "VmRSS", "VmHWM", "RssAnon", "RssFile", "prefix tokens",
                                 "prefix hits", "evicted", "threads", "fds", "failed"], rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5, help="rounds before growth is measured (default 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens of the long and disconnected requests")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds to wait once idle before reading")
    ap.add_argument("--rows-per-round", type=int, default=397,
                    help="how far the text offset moves each round (rows of train_prompts.jsonl)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `unmask serve` argument")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="server environment")
    ap.add_argument("--max-slope-mb", type=float, default=5.0)
    ap.add_argument("--name", default="bench_rss_soak")
    args = ap.parse_args(argv)
    from unmask.training.realmodel import ensure_default_converted

    env_extra = dict(e.split("=", 1) for e in args.env)
    serve_args = ["--threads", str(args.threads), "--log-level", "warning", *args.serve_arg]
    texts = Texts(str(ensure_default_converted()))  # the parent's tokenizer (the adapter directory has none)
    environment = bc.environment(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_rss_soak_") as tmp:
        proc, base = bc.start_server(serve_args, args.threads, Path(tmp) / "server.log", env=env_extra)
        try:
            model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            rows = asyncio.run(soak(args, base, proc.pid, model, texts))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except Exception:
                proc.kill()
            log_tail = (Path(tmp) / "server.log").read_text()[-3000:]
    failed = sum(k["sent"] - k["ok"] for r in rows for k in r["requests"].values())
    data = {"environment": environment, "model": model,
            "settings": {"rounds": args.rounds, "warmup": args.warmup, "threads": args.threads,
                         "max_tokens": args.max_tokens, "settle": args.settle, "serve_args": serve_args,
                         "env": args.env, "long_tokens": LONG_TOKENS, "rows_per_round": args.rows_per_round},
            "requests_per_round": {k: v["sent"] for k, v in rows[1]["requests"].items()},
            "rounds": rows, "verdict": verdict(rows, args.warmup), "failed_requests": failed,
            "server_log_tail": log_tail, "server_exit_code": proc.returncode}
    md = markdown(data)
    bc.write_results(args.name, data, md)
    print(md)
    return 0 if failed == 0 and data["verdict"]["slope_mb_per_round"] < args.max_slope_mb else 1


if __name__ == "__main__":
    raise SystemExit(main())
