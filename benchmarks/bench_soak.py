"""Soak: a tiny-model ``unmask serve`` under mixed normal, abusive and disconnecting traffic for a bounded time,
with the server's resident memory (RSS) sampled at a fixed interval (issue 22, docs/reliability-load.md).

What it does:

1. writes a tiny random a2d checkpoint (``tests/tiny.py``) and starts ``unmask serve`` on it, on 127.0.0.1 only;
2. runs ``--clients`` concurrent clients for ``--minutes`` minutes; each picks, per request, one kind from
   :data:`KINDS` (weights in brackets): normal completions and chats, streamed (with the denoising stream), ``n: 2``,
   ``/v1/responses`` (plain and streamed), chats with ``tools`` (``tool_choice: required``, so a call is made) and
   with a ``response_format`` JSON schema; clients that disconnect in the middle of a stream or before a plain
   answer; abusive requests (invalid JSON, a wrong content type, a 256 KiB field, over-limit values, a prompt longer
   than the context, unknown routes, bad ``/v1/responses`` bodies); the server runs with a compact tools-capable
   template (``tests/server/test_tools.py`` ``TOOLS_TEMPLATE``: the tiny model has 512 positions);
3. samples the server's RSS (``/proc/PID/status`` ``VmRSS``) and ``/health`` every ``--sample-seconds``;
4. writes ``benchmarks/results/bench_soak.json`` + ``.md`` + ``.png``: per-kind counts and status codes, failures
   (a 5xx, a connection error, a normal request without its tokens, or an abusive one not answered 4xx), and the
   RSS growth after warm-up: ``(last sample - first sample after --warmup-minutes) / that sample`` (target < 10%).

Exit status 0 when there were no failures and the growth is below ``--max-growth`` (default 0.10), else 1.

Run: ``nice -n 15 .venv/bin/python benchmarks/bench_soak.py --minutes 60`` (loopback only; nothing else is
contacted). A short check: ``--minutes 2 --warmup-minutes 0.5 --sample-seconds 10``.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (environment, free_port, markdown_table, proc_status_kib, save_figure, stop_server,  # noqa: E402
                          write_results)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
BIG = "x" * (256 * 1024)
# kind -> (weight, class): "normal" must succeed with tokens, "abusive" must be a 4xx, "disconnect" must not hurt
KINDS = {
    "completion": (4, "normal"), "chat": (4, "normal"), "stream_chat": (4, "normal"),
    "stream_denoising": (2, "normal"), "n2": (2, "normal"),
    "responses": (2, "normal"), "responses_stream": (2, "normal"), "tools_chat": (2, "normal"),
    "json_schema": (2, "normal"),
    "disconnect_stream": (3, "disconnect"), "disconnect_plain": (2, "disconnect"),
    "bad_json": (1, "abusive"), "wrong_content_type": (1, "abusive"), "huge_field": (1, "abusive"),
    "over_limit": (2, "abusive"), "prompt_over_context": (1, "abusive"), "unknown_route": (1, "abusive"),
    "bad_responses": (1, "abusive"),
    # issue 41: bodies slow to validate (server/body_limits.py) and requests past --max-step-rows
    "too_complex": (1, "abusive"), "over_step_rows": (1, "abusive"),
}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


@functools.lru_cache(maxsize=None)
def _test_helpers():
    """``tests/tiny.py`` ``loaded`` and the tools template + tool of ``tests/server/test_tools.py``."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "server")]
    from test_tools import TOOLS_TEMPLATE, WEATHER
    from tiny import loaded
    return loaded, TOOLS_TEMPLATE, WEATHER


def start_server(tmp: Path, port: int, block_size: int) -> subprocess.Popen:
    """Write the tiny checkpoint and start ``unmask serve`` on it at ``127.0.0.1:port`` with the tools template
    (log in ``tmp``)."""
    loaded, template, _ = _test_helpers()

    from unmask.engine.checkpoint import write_checkpoint

    m = loaded(block_size=block_size)
    ckpt = write_checkpoint(tmp / "tiny-a2d", m.model, m.tokenizer, m.dllm)
    del m
    (tmp / "tools.jinja").write_text(template)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    log = open(tmp / "server.log", "w")
    return subprocess.Popen([sys.executable, "-m", "unmask.cli.main", "serve", str(ckpt), "--host", "127.0.0.1",
                             "--port", str(port), "--served-model-name", MODEL, "--log-level", "warning",
                             "--chat-template", str(tmp / "tools.jinja")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


async def wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if (await client.get("/health", timeout=2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("server did not become healthy")


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random) -> tuple[str, bool]:
    """Send one request of ``kind``; returns ``(outcome label, ok)``."""
    words = rng.choice(["Hello", "The quick brown fox", "One two three", "What is the capital of France?"])
    tokens = rng.randint(4, 24)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": tokens}
    if kind == "completion":
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": words, "max_tokens": tokens})
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        return str(r.status_code), ok
    if kind == "chat":
        r = await client.post("/v1/chat/completions", json=chat)
        return str(r.status_code), r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    if kind == "n2":
        r = await client.post("/v1/chat/completions", json={**chat, "n": 2})
        return str(r.status_code), r.status_code == 200 and len(r.json()["choices"]) == 2
    if kind in ("stream_chat", "stream_denoising", "disconnect_stream"):
        body = {**chat, "stream": True}
        if kind == "stream_denoising":
            body["stream_options"] = {"include_denoising": True}
        if kind == "disconnect_stream":
            body["max_tokens"] = 64
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            status = r.status_code
            chunks, done = 0, False
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    done = line == "data: [DONE]"
                    if kind == "disconnect_stream" and chunks >= rng.randint(1, 3):
                        return "disconnected", status == 200  # leaving the block closes the connection
        return str(status), status == 200 and done and chunks > 1
    if kind == "responses":
        r = await client.post("/v1/responses", json={"model": MODEL, "input": words, "max_output_tokens": tokens,
                                                     "instructions": rng.choice([None, "Be brief."])})
        return str(r.status_code), r.status_code == 200 and r.json()["usage"]["output_tokens"] > 0
    if kind == "responses_stream":
        body = {"model": MODEL, "input": [{"role": "user", "content": words}], "max_output_tokens": tokens,
                "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as r:
            events = [line[7:] async for line in r.aiter_lines() if line.startswith("event: ")]
        end = events[-1] if events else ""
        return str(r.status_code), r.status_code == 200 and end in ("response.completed", "response.incomplete")
    if kind == "tools_chat":
        body = {**chat, "tools": [_test_helpers()[2]], "tool_choice": "required", "max_tokens": 128,
                "seed": rng.randint(0, 9)}
        r = await client.post("/v1/chat/completions", json=body)
        return str(r.status_code), r.status_code == 200 and bool(r.json()["choices"][0]["message"]["tool_calls"])
    if kind == "json_schema":
        r = await client.post("/v1/chat/completions", json={
            **chat, "max_tokens": 48, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "r", "schema": SCHEMA}}})
        if r.status_code != 200:
            return str(r.status_code), False
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            return "200:length", True
        value = json.loads(choice["message"]["content"])
        return "200", set(value) == {"ok", "n"}
    if kind == "disconnect_plain":
        try:
            await client.post("/v1/completions", json={"model": MODEL, "prompt": words, "max_tokens": 64},
                              timeout=rng.uniform(0.01, 0.3))
            return "answered", True
        except httpx.TimeoutException:
            return "disconnected", True
    if kind == "bad_json":
        r = await client.post("/v1/chat/completions", content=rng.choice([b"{", b"{\"model\": ", b"\xff\xfe", b"[]",
                                                                           b"null", b"{\"messages\": 3}"]),
                              headers={"Content-Type": "application/json"})
    elif kind == "wrong_content_type":
        r = await client.post("/v1/completions", content=b"prompt=hi", headers={"Content-Type": "text/plain"})
    elif kind == "huge_field":
        field = rng.choice(["user", "stop", "model", "content"])
        body = dict(chat)
        if field == "content":
            body["messages"] = [{"role": rng.choice(["user", "wizard"]), "content": [{"type": "image", "x": BIG}]}]
        else:
            body[field] = BIG if field != "stop" else [BIG]
        r = await client.post("/v1/chat/completions", json=body)
    elif kind == "over_limit":
        bad = rng.choice([{"max_tokens": 10 ** 9}, {"n": 0}, {"temperature": 9}, {"top_p": 0}, {"n": -3},
                          {"max_tokens": "many"}, {"seed": -1}, {"stop": ["a"] * 10}, {"logprobs": "yes"}])
        r = await client.post("/v1/chat/completions", json={**chat, **bad})
    elif kind == "prompt_over_context":
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "fox " * 2000, "max_tokens": 4})
    elif kind == "bad_responses":
        bad = rng.choice([{"input": []}, {"block_size": 10 ** 6}, {"max_output_tokens": 0}, {"top_k": -2},
                          {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
                          {"previous_response_id": "resp_1"}, {"tool_choice": "sometimes"}, {"input": 3}])
        r = await client.post("/v1/responses", json={"model": MODEL, "input": words, **bad})
    elif kind == "too_complex":
        parts = [{"type": "text", "text": "a"}] * 50_000
        body = rng.choice([{**chat, "messages": [{"role": "user", "content": parts}]},
                           {**chat, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5000)]},
                           {**chat, "metadata": {"k": json.loads("[" * 100 + "]" * 100)}},
                           # 3.6 MB of 900,000 one-element lists: past the body's container bound before any parse
                           {"model": MODEL, "prompt": [[1]] * 900_000}])
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = await client.post(path, content=json.dumps(body, separators=(",", ":")).encode(),
                              headers={"Content-Type": "application/json"})
    elif kind == "over_step_rows":
        r = await client.post("/v1/chat/completions", json={**chat, "block_size": 256, "max_tokens": 256,
                                                            "n": rng.choice([1, 2])})
    else:  # unknown_route
        r = await client.request(rng.choice(["GET", "POST"]), rng.choice(["/v1/nothing", "/v2/chat", "/v1/models/x"]))
    return str(r.status_code), 400 <= r.status_code < 500


async def client_loop(client, stop_at: float, seed: int, stats: dict) -> None:
    rng = random.Random(seed)
    names, weights = list(KINDS), [w for w, _ in KINDS.values()]
    while time.time() < stop_at:
        kind = rng.choices(names, weights)[0]
        t0 = time.perf_counter()
        try:
            label, ok = await one_request(client, kind, rng)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            label, ok = f"error:{type(exc).__name__}", False
        stats["outcomes"][kind][label] += 1
        stats["latency_s"][kind].append(time.perf_counter() - t0)
        if not ok:
            stats["failures"].append({"t": round(time.time() - stats["t0"], 1), "kind": kind, "outcome": label})


async def soak(args) -> dict:
    from bench_common import RESULTS  # noqa: F401 (results directory exists with the module)

    tmp = Path(tempfile.mkdtemp(prefix="unmask-soak-"))
    port = args.port or free_port()
    proc = start_server(tmp, port, args.block_size)
    samples: list[dict] = []
    stats = {"outcomes": defaultdict(Counter), "latency_s": defaultdict(list), "failures": [], "t0": time.time()}
    try:
        limits = httpx.Limits(max_connections=args.clients + 4)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
            await wait_healthy(client, proc)
            t0 = stats["t0"] = time.time()
            stop_at = t0 + args.minutes * 60
            tasks = [asyncio.create_task(client_loop(client, stop_at, args.seed + i, stats))
                     for i in range(args.clients)]
            while True:
                now = time.time()
                try:
                    health = (await client.get("/health", timeout=30)).status_code
                except httpx.HTTPError as exc:
                    health = f"error:{type(exc).__name__}"
                done = sum(sum(c.values()) for c in stats["outcomes"].values())
                samples.append({"t_min": round((now - t0) / 60, 3), "rss_mib": round(proc_status_kib(proc.pid) / 1024, 1),
                                "health": health, "requests": done})
                print(f"[soak] {samples[-1]}", flush=True)
                if now >= stop_at or proc.poll() is not None:
                    break
                await asyncio.sleep(min(args.sample_seconds, max(0.0, stop_at - time.time())))
            await asyncio.gather(*tasks)
            samples.append({"t_min": round((time.time() - t0) / 60, 3), "rss_mib": round(proc_status_kib(proc.pid) / 1024, 1),
                            "health": (await client.get("/health", timeout=30)).status_code,
                            "requests": sum(sum(c.values()) for c in stats["outcomes"].values())})
    finally:
        stop_server(proc)
    return summarize(args, samples, stats, proc.returncode, tmp)


def summarize(args, samples: list[dict], stats: dict, server_rc, tmp: Path) -> dict:
    after = [s for s in samples if s["t_min"] >= args.warmup_minutes] or samples[-1:]
    base, last = after[0]["rss_mib"], samples[-1]["rss_mib"]
    peak = max(s["rss_mib"] for s in after)
    outcomes = {k: dict(v) for k, v in stats["outcomes"].items()}
    by_class = Counter()
    for kind, counts in outcomes.items():
        by_class[KINDS[kind][1]] += sum(counts.values())
    lat = {k: sorted(v) for k, v in stats["latency_s"].items()}
    return {
        "settings": {"minutes": args.minutes, "warmup_minutes": args.warmup_minutes,
                     "sample_seconds": args.sample_seconds, "clients": args.clients, "block_size": args.block_size,
                     "seed": args.seed, "kinds": {k: {"weight": w, "class": c} for k, (w, c) in KINDS.items()}},
        "environment": environment(1),
        "samples": samples,
        "rss_mib": {"start": samples[0]["rss_mib"], "after_warmup": base, "end": last, "peak_after_warmup": peak,
                    "growth_after_warmup": (last - base) / base, "peak_growth_after_warmup": (peak - base) / base},
        "requests": {"total": sum(by_class.values()), **dict(by_class)},
        "outcomes": outcomes,
        "latency_s": {k: {"median": v[len(v) // 2], "p99": v[min(len(v) - 1, int(len(v) * 0.99))], "n": len(v)}
                      for k, v in lat.items() if v},
        "failures": {"count": len(stats["failures"]), "first": stats["failures"][:20]},
        "server_exit_code": server_rc,
        "server_log_tail": (tmp / "server.log").read_text()[-2000:],
    }


def markdown(data: dict) -> str:
    r, s = data["rss_mib"], data["settings"]
    rows = [[k, sum(v.values()), ", ".join(f"{lab}: {n}" for lab, n in sorted(v.items())),
             data["latency_s"].get(k, {}).get("median", float("nan"))] for k, v in sorted(data["outcomes"].items())]
    return (f"Soak of a tiny-model server: {s['minutes']} min, {s['clients']} concurrent clients, "
            f"{data['requests']['total']} requests ({data['requests'].get('normal', 0)} normal, "
            f"{data['requests'].get('abusive', 0)} abusive, {data['requests'].get('disconnect', 0)} disconnecting); "
            f"failures: {data['failures']['count']}.\n\n"
            f"RSS: {r['start']} MiB at start, {r['after_warmup']} MiB after the {s['warmup_minutes']}-min warm-up, "
            f"{r['end']} MiB at the end (growth after warm-up {100 * r['growth_after_warmup']:+.1f}%, peak "
            f"{r['peak_after_warmup']} MiB = {100 * r['peak_growth_after_warmup']:+.1f}%; target < 10%).\n\n"
            + markdown_table(["kind", "requests", "outcomes (status: count)", "median s"], rows)
            + "\n" + markdown_table(["minute", "RSS MiB", "requests so far", "/health"],
                                    [[x["t_min"], x["rss_mib"], x["requests"], x["health"]] for x in data["samples"]]))


def plot(data: dict, warmup: float):
    def draw(path):
        import matplotlib.pyplot as plt

        t = [x["t_min"] for x in data["samples"]]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(t, [x["rss_mib"] for x in data["samples"]], marker="o", ms=3)
        ax.axvline(warmup, color="grey", ls="--", lw=1, label="end of warm-up")
        ax.set_xlabel("minutes")
        ax.set_ylabel("server RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"unmask serve soak (tiny model): {data['requests']['total']} mixed requests")
        ax.legend()
        save_figure(fig, path)
    return draw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="duration of the traffic (default 60)")
    ap.add_argument("--warmup-minutes", type=float, default=5.0, help="growth is measured from this minute on")
    ap.add_argument("--sample-seconds", type=float, default=60.0, help="RSS sampling interval (default 60)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="loopback port (default: a free one)")
    ap.add_argument("--max-growth", type=float, default=0.10, help="exit 1 above this RSS growth after warm-up")
    ap.add_argument("--name", default="bench_soak", help="result name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.warmup_minutes >= args.minutes or args.sample_seconds <= 0 or args.clients < 1:
        ap.error("need --minutes > --warmup-minutes >= 0, --sample-seconds > 0, --clients >= 1")
    data = asyncio.run(soak(args))
    md = markdown(data)
    print(md)
    print("wrote", write_results(args.name, data, md, plot(data, args.warmup_minutes)))
    ok = data["failures"]["count"] == 0 and data["rss_mib"]["growth_after_warmup"] < args.max_growth
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
