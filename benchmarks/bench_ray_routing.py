"""Prefix-aware routing across Ray Serve replicas vs round-robin (issue 46; docs/design.md#scale-out).

Multi-turn chat traffic with shared prefixes: ``--chats`` conversations run at once, each ``--turns`` turns long
(every turn resends the whole conversation: one system prompt shared by all chats, the chat's own opening, the
model's greedy answers, short follow-ups), streamed. The same traffic (the same texts, new ones each repeat) goes to:

* ``single``: one plain ``unmask serve`` (the baseline: one prefix cache sees every turn);
* ``prefix``: ``unmask serve --ray`` with 2 engine replicas and unmask's prefix-aware router;
* ``round_robin``: the same 2 replicas taken in turn (what nginx in docker/compose.replicas.yaml does);
* ``power_of_two``: Ray Serve's default router (two random replicas, the less loaded).

Per mode: the cache hit rate = prompt tokens loaded from a prefix cache / prompt tokens, from the servers' own
``/metrics`` (each replica's endpoint, summed; the primary figure), the same from the responses' ``cached_tokens``
as a check, the share of requests per replica, and the time to first token of the streamed turns (median, p90;
on 2 shared cores it is mostly contention). The modes run one after another on a local Ray cluster of a head and
two worker nodes (``ray.cluster_utils.Cluster``). Model: the tiny random a2d model of ``tests/tiny.py`` by
default (hit rates depend on the token ids, not on the weights), or ``--model DIR``.

    .venv/bin/python benchmarks/bench_ray_routing.py --repeats 2
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench_common as bc

NAME = "bench_ray_routing"
MODES = ("single", "prefix", "round_robin", "power_of_two")
SYSTEM = "You are a helpful assistant for a small bakery. Be brief, friendly and concrete in every answer."
OPENINGS = ["Do you bake rye bread on weekdays", "Can I order a birthday cake for Friday", "What time do you open",
            "Is the croissant dough made with butter", "Do you have anything without nuts", "Where can I park",
            "Can I pay by card", "Do you sell coffee", "Are the cookies vegan", "Do you deliver to the office",
            "How long does sourdough keep", "Can you slice the bread for me"]
FOLLOW_UPS = ["Thanks. And the price?", "Great, one more question.", "OK. Anything else I should know?",
              "Perfect, see you soon."]


def chats(n: int, repeat: int) -> list[list[dict]]:
    """The opening turns of ``n`` conversations (new texts each ``repeat``)."""
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"{OPENINGS[(i + repeat * n) % len(OPENINGS)]}? (order {repeat}-{i})"}]
            for i in range(n)]


def stream_turn(base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: the answer, its time to first content chunk and its usage."""
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, ttft, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += c["delta"]["content"]
            usage = chunk.get("usage") or usage
    return {"text": text, "ttft": ttft, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def traffic(base: str, model: str, n_chats: int, turns: int, max_tokens: int, repeat: int) -> list[dict]:
    """Every chat as a client of its own (all at once), its turns one after another; every turn's record."""
    records: list[dict] = []
    lock = threading.Lock()

    def client(i: int, messages: list[dict]):
        for t in range(turns):
            rec = stream_turn(base, model, messages, max_tokens)
            with lock:
                records.append({**rec, "chat": i, "turn": t})
            messages = messages + [{"role": "assistant", "content": rec["text"]},
                                   {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]

    threads = [threading.Thread(target=client, args=(i, m)) for i, m in enumerate(chats(n_chats, repeat))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return records


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"unmask:{name}{{"))


def endpoints(base: str, mode: str) -> dict:
    """``name -> /metrics URL`` of every engine: the plain server's own, or each replica's."""
    import httpx

    if mode == "single":
        return {"server": base + "/metrics"}
    return {rid: w["metrics"] for rid, w in httpx.get(base + "/replicas", timeout=10).json().items()}


def counters(urls: dict) -> dict:
    import httpx

    out = {}
    for name, url in urls.items():
        text = httpx.get(url, timeout=10).text
        out[name] = (metric(text, "prefix_cache_queries_total"), metric(text, "prefix_cache_hits_total"))
    return out


def start(mode: str, ckpt: str, address: str | None, common: list[str], log: Path, extra: list[str]):
    """The server of ``mode``: ``(process, base URL)``; ``extra``: more ``unmask serve --ray`` options."""
    args = [ckpt, *common]
    if mode != "single":
        args += ["--ray", "--ray-address", address, "--ray-min-replicas", "2", "--ray-router", mode, *extra]
    return bc.start_server(args, threads=1, log_path=log, timeout=600)


def warm(base: str, model: str, mode: str) -> dict:
    """A request per replica (idle replicas are taken in turn by every router but power_of_two), so that both have
    reported where they are before the counters are read."""
    import httpx

    for i in range(4 if mode != "single" else 1):
        httpx.post(base + "/v1/completions", json={"model": model, "prompt": f"warm {i}", "max_tokens": 2},
                   timeout=300).raise_for_status()
    return endpoints(base, mode)


def run_mode(mode: str, ckpt: str, model: str, address: str | None, a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"{NAME}-{mode}-"))
    proc, base = start(mode, ckpt, address, ["--max-batch-size", "4", "--threads", "1"], tmp / "server.log",
                       a.ray_args.split())
    try:
        urls = warm(base, model, mode)
        repeats = []
        for r in range(a.repeats):
            before = counters(urls)
            recs = traffic(base, model, a.chats, a.turns, a.answer_tokens, r)
            urls = endpoints(base, mode) if mode != "single" else urls
            after = counters(urls)
            q = {k: after[k][0] - before.get(k, (0, 0))[0] for k in after}
            h = {k: after[k][1] - before.get(k, (0, 0))[1] for k in after}
            ttfts = sorted(x["ttft"] for x in recs if x["ttft"] is not None)
            repeats.append({"hit_rate": sum(h.values()) / max(1, sum(q.values())),
                            "hit_rate_usage": sum(x["cached"] for x in recs) / max(1, sum(x["prompt"] for x in recs)),
                            "prompt_tokens_per_replica": q, "hits_per_replica": h,
                            "ttft_median_s": bc.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
                            "requests": len(recs), "records": recs})
        return {"mode": mode, "repeats": repeats, "hit_rate": bc.median([x["hit_rate"] for x in repeats]),
                "ttft_median_s": bc.median([x["ttft_median_s"] for x in repeats])}
    finally:
        bc.stop_server(proc, timeout=60)


def tiny_checkpoint(out: Path) -> str:
    """The tiny random a2d model of tests/tiny.py written to ``out`` (what the tests serve)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import loaded

    from unmask.engine.checkpoint import write_checkpoint

    m = loaded(block_size=4)
    write_checkpoint(str(out), m.model, m.tokenizer, m.dllm)
    return str(out)


def markdown(results: list[dict], a) -> str:
    single = next(r for r in results if r["mode"] == "single")["hit_rate"]
    rows = []
    for r in results:
        shares = [sum(x["prompt_tokens_per_replica"].values()) and
                  max(x["prompt_tokens_per_replica"].values()) / sum(x["prompt_tokens_per_replica"].values())
                  for x in r["repeats"]]
        rows.append([r["mode"], "1 (plain)" if r["mode"] == "single" else "2", r["hit_rate"],
                     r["hit_rate"] / single if single else float("nan"),
                     bc.median([x["hit_rate_usage"] for x in r["repeats"]]), bc.median(shares),
                     r["ttft_median_s"] * 1000, bc.median([x["ttft_p90_s"] for x in r["repeats"]]) * 1000])
    table = bc.markdown_table(["mode", "replicas", "cache hit rate (/metrics)", "x single", "hit rate (usage)",
                               "busiest replica's share of prompt tokens", "TTFT median (ms)", "TTFT p90 (ms)"], rows)
    return (f"{a.chats} chats at once x {a.turns} turns, answers of {a.answer_tokens} tokens, {a.repeats} repeats "
            f"(medians); model: {a.model or 'tiny random a2d (tests/tiny.py)'}\n\n" + table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the tiny random a2d model)")
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--ray-args", default="", help="more options of the Ray modes' unmask serve --ray, e.g. "
                                                   "'--ray-load-weight 4'")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if modes[0] != "single" or any(m not in MODES for m in modes):
        ap.error(f"--modes: start with single, then any of {', '.join(MODES[1:])}")
    env = bc.environment(1)
    import ray
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix=NAME))
    ckpt = a.model or tiny_checkpoint(work / "tiny-a2d")
    model = Path(ckpt.rstrip("/")).name
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    try:
        results = [run_mode(m, ckpt, model, cluster.address, a) for m in modes]
    finally:
        ray.shutdown()
        cluster.shutdown()
    data = {"settings": vars(a), "environment": env, "results": results}
    return bc.report(NAME, data, markdown(results, a))


if __name__ == "__main__":
    bc.run_script(main)
