"""Issue 22's hardening, measured on the tiny test model in-process (docs/design.md#admission-and-limits;
docs/reliability.md).

Three figures, each beside the behaviour before the fix where that can be reproduced in the same run:

* **bad inputs**: every oversized request of ``tests/server/test_hardening_inproc.py`` (block 65536, block 4096 with
  ``max_tokens: 1``, steps 10^9, ...): status, the field named, seconds;
* **fair admission**: a request of ``--max-seqs-per-request`` (64) sequences x 500 tokens (the tiny model's context is 512) (``ignore_eos``) fills
  the batch of 16; then 4-token requests are sent one after the other: seconds to their first event with the fair
  scheduler and with first-come-first-served admission (the old ``Scheduler._admit``, reproduced here), capped at
  ``--fifo-timeout`` seconds;
* **event loop**: the longest silence between ``/health`` answers (probed every 50 ms) while a request's tokenizer
  takes 2 s per call (a tokenizer on the event loop would show the whole 2 s).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_hardening.py`` (about a minute on 2 cores); writes
``benchmarks/results/bench_hardening.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "server"))


def bad_inputs(model) -> list[dict]:
    from fastapi.testclient import TestClient

    from test_hardening_inproc import BOUNDED
    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.app import build_app

    eng = AsyncEngine(model, max_batch_size=4, max_queue=64)
    rows = []
    try:
        with TestClient(build_app(eng, "m", shutdown_engine=False, max_seqs_per_request=8)) as client:
            for extra, field in BOUNDED:
                body = {"model": "m", "prompt": "Hello", "max_tokens": 8, "seed": 0, **extra}
                t0 = time.perf_counter()
                r = client.post("/v1/completions", json=body)
                shown = {k: (v if len(json.dumps(v)) < 40 else f"<{len(json.dumps(v))} bytes>") for k, v in extra.items()}
                rows.append({"request": shown, "status": r.status_code, "param": r.json()["error"]["param"],
                             "expected": field, "seconds": round(time.perf_counter() - t0, 4)})
    finally:
        eng.shutdown()
    return rows


def _fifo_admit(self) -> None:
    """The scheduler's admission before issue 22: first come, first served."""
    while self.waiting and len(self.running) < self.max_batch_size:
        seq = self.waiting[0]
        if (self.max_cached_tokens is not None and self.running
                and self.reserved_tokens() + self.need(seq) > self.max_cached_tokens):
            break
        self.waiting.popleft()
        self.running.append(seq)


def admission(model, fair: bool, smalls: int, timeout: float) -> list[float | None]:
    from unmask.engine import SamplingParams
    from unmask.engine.async_engine import AsyncEngine
    from unmask.engine.limits import DEFAULT_MAX_SEQS_PER_REQUEST

    eng = AsyncEngine(model, max_batch_size=16, max_queue=256)
    if not fair:
        eng.scheduler._admit = _fifo_admit.__get__(eng.scheduler)
    big = SamplingParams(max_tokens=500, ignore_eos=True, temperature=1.0, seed=0)
    small = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)

    async def run():
        s_big = eng.submit([5, 6, 7, 8], big, "big", n=DEFAULT_MAX_SEQS_PER_REQUEST)
        async for _ in s_big:
            break
        waits: list[float | None] = []
        for k in range(smalls):
            t0 = time.perf_counter()
            s = eng.submit([9, 8, 7, k + 3], small, f"small-{k}")
            try:
                await asyncio.wait_for(s.__anext__(), timeout)
                waits.append(round(time.perf_counter() - t0, 4))
                async for _ in s:
                    pass
            except asyncio.TimeoutError:
                waits.append(None)  # no first token within the timeout
                s.abort()
        s_big.abort()
        async for _ in s_big:
            pass
        return waits

    try:
        return asyncio.run(run())
    finally:
        eng.shutdown()


def event_loop(model, delay: float = 2.0) -> dict:
    import httpx

    from test_hardening_inproc import SlowTokenizer
    from unmask.engine.async_engine import AsyncEngine
    from unmask.server.app import build_app

    eng = AsyncEngine(model)
    app = build_app(eng, "m", shutdown_engine=False)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30) as c:
            done, answers = asyncio.Event(), []

            async def prober():  # /health every 50 ms; a stalled event loop shows as a gap between answers
                while not done.is_set():
                    await c.get("/health")
                    answers.append(time.perf_counter())
                    await asyncio.sleep(0.05)

            probes = asyncio.create_task(prober())
            await asyncio.sleep(0.2)
            app.state.unmask.tokenizer = SlowTokenizer(eng.tokenizer, delay)
            t0 = time.perf_counter()
            await c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
            t1 = time.perf_counter()
            done.set()
            await probes
            inside = [t0] + [t for t in answers if t0 <= t <= t1] + [t1]
            return len(inside) - 2, max(b - a for a, b in zip(inside, inside[1:]))

    try:
        n, gap = asyncio.run(run())
    finally:
        eng.shutdown()
    return {"tokenizer_seconds_per_call": delay, "health_answers_meanwhile": n,
            "longest_health_silence_seconds": round(gap, 4), "probe_interval_seconds": 0.05}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smalls", type=int, default=3)
    ap.add_argument("--fifo-timeout", type=float, default=20.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_hardening.json"))
    args = ap.parse_args()
    import torch

    from tiny import loaded

    torch.set_num_threads(1)
    model = loaded(block_size=4)
    rows = bad_inputs(model)
    fair = admission(model, True, args.smalls, args.fifo_timeout)
    fifo = admission(model, False, 1, args.fifo_timeout)
    loop = event_loop(model)
    result = {
        "benchmark": "bench_hardening", "command": "OMP_NUM_THREADS=1 python benchmarks/bench_hardening.py",
        "model": "tests/tiny.py loaded(block_size=4) (context 512)",
        "bad_inputs": {"tried": len(rows), "all_400_naming_the_field": all(
            r["status"] == 400 and r["param"] == r["expected"] for r in rows),
            "max_seconds": max(r["seconds"] for r in rows), "rows": rows},
        "admission": {"large_request": "64 sequences x 500 tokens (the tiny context is 512), ignore_eos, batch 16",
                      "small_first_event_seconds_fair": fair,
                      "small_first_event_seconds_fifo": fifo, "fifo_timeout_seconds": args.fifo_timeout},
        "event_loop": loop,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "bad_inputs"}, indent=2))
    print("bad inputs:", result["bad_inputs"]["tried"], "all 400:", result["bad_inputs"]["all_400_naming_the_field"],
          "max s:", result["bad_inputs"]["max_seconds"])


if __name__ == "__main__":
    main()
