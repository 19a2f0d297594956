"""Time to first token of a chat's fifth turn with and without prefix reuse (issue 25; docs/design.md#prefix-reuse).

A realistic 5-turn conversation (a system prompt and five user turns; the model's own greedy answers of at most
``--answer-tokens`` tokens are the assistant turns), rendered with the model's chat template, so every turn resends
the whole conversation. Each repeat, alternated so that drifting machine load hits both:

* reuse: a fresh engine with prefix caching runs turns 1-4 to the end (what a server has done before the fifth
  turn arrives), then turn 5 is timed from ``add_request`` to its first revealed token;
* no reuse: a fresh engine without prefix caching times turn 5 the same way.

Medians over repeats; the tokens of turn 5's first ``--check-tokens`` tokens are compared between the two.
Real model: the A2D conversion of SmolLM2-135M-Instruct (``bench_common.real_model``), block 1 (the default
model's greedy path), greedy. ``--tiny`` runs the tiny random model of ``tests/tiny.py`` (a smoke test).

    .venv/bin/python benchmarks/bench_prefix_reuse.py --repeats 5
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import bench_common as bc

SYSTEM = ("You are a friendly travel assistant. Answer in a few short sentences, be concrete, and ask a follow-up "
          "question when the traveller's plans are unclear.")
USER_TURNS = [
    "Hi! I'm planning a week in Portugal in early October with my partner. Where should we start?",
    "We like food and walking more than museums. Is Lisbon or Porto better for that?",
    "Great, let's do both. How should we get from Lisbon to Porto, and how long does it take?",
    "What are two day trips from Porto that don't need a car?",
    "Can you put it all together into a simple day-by-day plan for the seven days?",
]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids of ``messages`` with the generation prompt: the chat template when the tokenizer has one, else
    ``role: content`` lines (the tiny test tokenizer)."""
    if getattr(tokenizer, "chat_template", None):
        from unmask.engine.llm import chat_prompt_ids

        return chat_prompt_ids(tokenizer, messages)  # what the server sends the engine
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer.encode(text, add_special_tokens=False)


def run_to_end(engine, prompt_ids, params, rid: str):
    """The finished :class:`CompletionOutput` of one request run alone."""
    engine.add_request(prompt_ids, params, rid)
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished and ev.request_id == rid:
                out = ev.output
    return out


def time_first_token(engine, prompt_ids, params, rid: str) -> tuple[float, int, list[int]]:
    """``(seconds from add_request to the first revealed token, prompt tokens loaded from the prefix cache, the
    first tokens)``; the request runs until ``params.max_tokens`` (few) so that the tokens can be compared."""
    t0 = time.perf_counter()
    engine.add_request(prompt_ids, params, rid)
    ttft, seq = None, engine.scheduler.waiting[-1]
    while engine.has_unfinished():
        for ev in engine.step():
            if ttft is None and ev.request_id == rid and ev.num_tokens >= 1:
                ttft = time.perf_counter() - t0
    return ttft, seq.cached_tokens, list(seq.output_ids)


def conversation(engine, tokenizer, params) -> list[list[int]]:
    """Prompt ids of the five turns, the assistant turns being the model's own answers (run on ``engine``)."""
    messages, prompts = [{"role": "system", "content": SYSTEM}], []
    for t, user in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": user})
        prompts.append(render(tokenizer, messages))
        if t < len(USER_TURNS) - 1:
            out = run_to_end(engine, prompts[-1], params, f"turn-{t + 1}")
            messages.append({"role": "assistant", "content": out.text})
    return prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the SmolLM2 A2D conversion)")
    ap.add_argument("--tiny", action="store_true", help="the tiny random test model instead (a smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--answer-tokens", type=int, default=64, help="most tokens of each assistant turn")
    ap.add_argument("--check-tokens", type=int, default=8, help="turn-5 tokens generated (and compared)")
    ap.add_argument("--block-size", type=int, default=1)
    args = bc.parse_args(ap, argv, threads=1)
    from unmask.engine import SamplingParams
    from unmask.engine.engine import Engine

    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny import loaded

        model = loaded(block_size=4, max_position_embeddings=4096)
        model.max_context = 4096  # its tokenizer spells most words letter by letter
        model_desc = "tests/tiny.py loaded(block_size=4), context 4096"
    else:
        model = bc.real_model(args.model, block_size=args.block_size, weights=args.weights)
        model_desc = f"{model.path} ({model.weight_format} weights)"
    answer = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, block_size=args.block_size,
                            speculative=False)
    first = SamplingParams(max_tokens=args.check_tokens, temperature=0.0, block_size=args.block_size,
                           speculative=False, ignore_eos=True)
    env = bc.environment(args.threads)
    prompts = conversation(Engine(model, enable_prefix_caching=False), model.tokenizer, answer)
    turn5 = prompts[-1]
    runs = {"reuse": [], "no reuse": []}
    for r in range(args.repeats):
        for mode in runs:  # alternated
            engine = Engine(model, enable_prefix_caching=mode == "reuse")
            if mode == "reuse":
                for t, p in enumerate(prompts[:-1]):
                    run_to_end(engine, p, answer, f"r{r}-turn-{t + 1}")
            ttft, cached, ids = time_first_token(engine, turn5, first, f"r{r}-turn-5")
            runs[mode].append({"ttft_s": ttft, "cached_tokens": cached, "token_ids": ids,
                               "prefix_cache": engine.prefix_cache_stats()})
    same = all(x["token_ids"] == runs["no reuse"][0]["token_ids"] for rs in runs.values() for x in rs)
    summary = {m: {"ttft_s": bc.median([x["ttft_s"] for x in rs]), "cached_tokens": rs[0]["cached_tokens"]}
               for m, rs in runs.items()}
    speedup = summary["no reuse"]["ttft_s"] / summary["reuse"]["ttft_s"]
    rows = [[m, len(turn5), s["cached_tokens"], len(turn5) - s["cached_tokens"], s["ttft_s"] * 1000,
             f"{summary['no reuse']['ttft_s'] / s['ttft_s']:.2f}x"] for m, s in summary.items()]
    md = (f"Time to first token of the fifth turn of a 5-turn chat ({model_desc}; block {args.block_size}, greedy, "
          f"assistant turns <= {args.answer_tokens} tokens), {args.repeats} repeats alternated (median). reuse = "
          f"the engine that served turns 1-4 with prefix caching; no reuse = prefix caching off. Same first "
          f"{args.check_tokens} tokens in both: {same}. Prompt lengths of the turns: "
          f"{', '.join(str(len(p)) for p in prompts)}.\n\n"
          + bc.markdown_table(["mode", "prompt tokens", "from the cache", "prefilled", "TTFT ms", "vs no reuse"],
                              rows))
    data = {"settings": vars(args), "model": model_desc, "environment": env, "prompt_lengths": [len(p) for p in prompts],
            "summary": summary, "ttft_speedup": speedup, "same_tokens": same, "runs": runs}
    bc.report("bench_prefix_reuse_tiny" if args.tiny else "bench_prefix_reuse", data, md)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
