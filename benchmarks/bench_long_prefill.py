"""Long prompts on the served default: prefill time, and how long a decoding stream stalls while another request's
long prompt is prefilled, with and without chunked prefill (docs/design.md#decoding, "Chunked prefill").

For the served default (``unmask serve`` with no MODEL) loaded with each ``--weights`` format and each
``--chunks`` setting (``--prefill-chunk`` tokens; 0 = the whole prompt in one step):

* ``prefill_s``: median seconds from submitting a ``P``-token prompt alone (random ids: the prefix cache never
  serves it) to its first token (block 1, ``max_tokens=1``), for each ``P`` in ``--lengths``;
* ``stall``: a block-1 stream (a grid prompt, ``--stream-tokens`` tokens, greedy) decodes; after its
  ``--join-after``-th token ``--joiners`` prompts of ``--stall-length`` tokens join at once; ``max_gap_s`` is the
  longest wait between two of the stream's tokens, ``median_gap_s`` its typical one, ``joiner_first_token_s`` /
  ``last_joiner_first_token_s`` the first / last joiner's time to its first token (medians of ``--repeats`` runs).

Results: ``benchmarks/results/bench_long_prefill.{json,md}`` (the latest run, whatever its ``--stall-length``).

``--compare-without-tiles`` measures the row-invariant formats a second time with prompt rows as one-row calls
instead of prompt tiles (``engine/row_attention.py``), in the same run.

    .venv/bin/python benchmarks/bench_long_prefill.py --weights auto,fp16 --chunks 0,256 --lengths 512,2048 \
        --stall-length 2048 --joiners 1,3 --threads 2 --compare-without-tiles
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import bench_common as bc


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def prefill_s(engine_cls, model, chunk: int, length: int, repeats: int, rng) -> float:
    """Median seconds to the first token of a ``length``-token prompt decoded alone (after one untimed run)."""
    from unmask.engine import SamplingParams

    sp = SamplingParams.from_flat(max_tokens=1, temperature=0.0, block_size=1, speculative=False, ignore_eos=True)
    secs = []
    for _ in range(repeats + 1):
        engine = engine_cls(model, max_batch_size=4, prefill_chunk=chunk, enable_prefix_caching=False)
        engine.add_request(_random_ids(rng, length, model.vocab_size - 1), sp, "long")
        t0 = time.perf_counter()
        while engine.has_unfinished():
            if engine.step():
                break
        secs.append(time.perf_counter() - t0)
    return statistics.median(secs[1:])


def stall(engine_cls, model, chunk: int, stream_ids: list[int], length: int, stream_tokens: int, join_after: int,
          rng, joiners: int = 1) -> dict:
    """One run of the stall measurement (see the module docstring); ``joiners`` long prompts join at once."""
    from unmask.engine import SamplingParams

    engine = engine_cls(model, max_batch_size=joiners + 3, prefill_chunk=chunk, enable_prefix_caching=False)
    greedy = dict(temperature=0.0, block_size=1, speculative=False, ignore_eos=True)
    engine.add_request(stream_ids, SamplingParams.from_flat(max_tokens=stream_tokens, **greedy), "stream")
    times, joined_at, firsts = [], None, {}
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            if ev.request_id == "stream" and ev.revealed:
                times.append(now)
            elif ev.request_id != "stream":
                firsts.setdefault(ev.request_id, now - joined_at)
        if joined_at is None and len(times) >= join_after:
            for j in range(joiners):
                engine.add_request(_random_ids(rng, length, model.vocab_size - 1),
                                   SamplingParams.from_flat(max_tokens=1, **greedy), f"long-{j}")
            joined_at = time.perf_counter()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps),
            "joiner_first_token_s": min(firsts.values()), "last_joiner_first_token_s": max(firsts.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="auto,fp16", help="comma-separated weight formats (auto = as served)")
    ap.add_argument("--chunks", default="0,256", help="comma-separated --prefill-chunk settings (0 = off)")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths of the prefill_s rows (tokens)")
    ap.add_argument("--stall-length", type=int, default=2048, help="the joining prompt's tokens")
    ap.add_argument("--stream-tokens", type=int, default=48)
    ap.add_argument("--join-after", type=int, default=8)
    ap.add_argument("--joiners", default="1", help="comma-separated counts of long prompts that join at once")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-without-tiles", action="store_true",
                    help="formats with row-invariant attention (int8/int4, auto on a 4-bit grid) are measured a "
                         "second time with prompt rows as one-row calls instead of prompt tiles (same run)")
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from unmask.cli.serve import default_model
    from unmask.engine.engine import Engine
    from unmask.engine.llm import chat_prompt_ids
    from unmask.engine.model import load_model

    served_path, _, what = default_model()
    rng = random.Random(0)
    chunks = [int(c) for c in args.chunks.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    settings = []
    for fmt in args.weights.split(","):
        model = load_model(served_path, weights=fmt)
        settings.append((fmt, model, True))
        if args.compare_without_tiles and model.tiles_prompt_rows:
            settings.append((fmt, model, False))
    for fmt, model, tiles in settings:
        if model.decoder_forward is not None:
            model.decoder_forward.prompt_tiles = tiles
        stream_ids = chat_prompt_ids(model.tokenizer, [{"role": "user", "content": bc.grid_prompts(1)[0]["prompt"]}],
                                     mask_token_id=model.dllm.mask_token_id)
        for chunk in chunks:
            row = {"weights": fmt if tiles else f"{fmt}, prompt rows one call each", "prefill_chunk": chunk}
            for n in lengths:
                row[f"prefill_s_{n}"] = prefill_s(Engine, model, chunk, n, args.repeats, rng)
                print(fmt, chunk, n, f"{row[f'prefill_s_{n}']:.2f} s", flush=True)
            for joiners in [int(j) for j in args.joiners.split(",")]:
                runs = [stall(Engine, model, chunk, stream_ids, args.stall_length, args.stream_tokens,
                              args.join_after, rng, joiners) for _ in range(args.repeats)]
                jrow = {**row, "joiners": joiners, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                print(jrow, flush=True)
                rows.append(jrow)
    data = {"benchmark": "bench_long_prefill", "served": what, "args": vars(args),
            "environment": bc.environment(args.threads), "rows": rows}
    cols = [f"prefill_s_{n}" for n in lengths] + ["max_gap_s", "median_gap_s", "joiner_first_token_s",
                                                  "last_joiner_first_token_s"]
    md = [f"# Long prompts: prefill and stalls ({what})", "",
          f"Stall: a {args.stall_length}-token "
          f"prompt joins after the stream's {args.join_after}th token; medians of {args.repeats} runs, seconds.", "",
          "| weights | prefill chunk | joiners | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        md.append(f"| {r['weights']} | {r['prefill_chunk'] or 'off'} | {r['joiners']} | "
                  + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    # another stall length is a result of its own: the default's figures stay in the file the docs cite
    name = "bench_long_prefill"  # one stable name: the latest run, whatever its --stall-length (git keeps the rest)
    return bc.report(name, data, "\n".join(md) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
