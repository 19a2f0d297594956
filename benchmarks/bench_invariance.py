"""Exactness of the served default's decoding in a weight format: a request's tokens alone vs in a batch, and
speculative greedy decoding vs the block-1 decoding it verifies (docs/design.md#decisions).

For the served default (``unmask serve`` with no MODEL: the parent + the shipped mask-row adapter) loaded with
``--weights`` (fp16 | int8 | int4), on the first ``--prompts`` held-out grid prompts (chat template, greedy, at most
``--max-tokens`` tokens):

* ``batched == alone``: each of block 1, speculative (the default draft block) and plain diffusion (block 4,
  threshold 0.5) decodes every prompt alone, then all of them in one batch (``--batch`` slots); the share of
  prompts whose tokens are the same;
* ``speculative == block 1``: speculative decoding's answer vs block-1 decoding's, each alone.

``prefill``: the median time of a ``--prefill-tokens`` prompt's prefill (random ids, so the prefix cache never
serves it), as the row-invariant attention makes a prompt's rows one call each; ``block-1 tokens/s``: all the
prompts decoded at once (``--batch`` slots), the throughput its per-lane calls cost.

With ``--compare-plain-attention`` the same is measured a second time with the fused decoder's row-invariant
attention switched off (one SDPA call per layer, as before it existed), in the same run.

    .venv/bin/python benchmarks/bench_invariance.py --weights int4 --prompts 24 --compare-plain-attention
"""
from __future__ import annotations

import argparse

import bench_common as bc


def measure(llm, ids: list, max_tokens: int) -> dict:
    """``{mode: batched == alone share, "spec_equals_block1": share}`` for ``llm`` on prompt ids ``ids``."""
    from unmask.engine import SamplingParams

    modes = {"block1": dict(block_size=1, speculative=False), "speculative": dict(speculative=True),
             "diffusion-b4-t0.5": dict(block_size=4, threshold=0.5, speculative=False)}
    out, alone_by_mode = {}, {}
    for name, kw in modes.items():
        sp = SamplingParams.from_flat(max_tokens=max_tokens, temperature=0.0, seed=0, **kw)
        alone = [llm.generate([i], sp)[0].outputs[0].token_ids for i in ids]
        batched = [o.outputs[0].token_ids for o in llm.generate(ids, sp)]
        out[f"{name}_batched_equals_alone"] = sum(a == b for a, b in zip(alone, batched)) / len(ids)
        alone_by_mode[name] = alone
        print(f"{name}: batched == alone {out[f'{name}_batched_equals_alone']:.3f}", flush=True)
    out["spec_equals_block1"] = sum(a == b for a, b in zip(alone_by_mode["speculative"], alone_by_mode["block1"])) \
        / len(ids)
    print(f"speculative == block 1: {out['spec_equals_block1']:.3f}", flush=True)
    return out


def prefill_ms(llm, tokens: int, repeats: int = 3) -> float:
    """Median milliseconds of one ``tokens``-token prompt's prefill (``max_tokens=1``, block 1; fresh random ids
    each time so the prefix cache never serves it)."""
    import random
    import time

    from unmask.engine import SamplingParams

    sp = SamplingParams.from_flat(max_tokens=1, temperature=0.0, block_size=1, speculative=False)
    rng = random.Random()  # unseeded: a later call must not repeat an earlier call's prompts (prefix cache)
    secs = []
    for _ in range(repeats + 1):
        ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
        t = time.perf_counter()
        llm.generate([ids], sp)
        secs.append(time.perf_counter() - t)
    return bc.median(secs[1:]) * 1e3


def batch_tokens_per_s(llm, ids: list, max_tokens: int) -> float:
    """Block-1 greedy tokens/s of all ``ids`` decoded in one ``generate`` (the batch slots full: throughput)."""
    import time

    from unmask.engine import SamplingParams

    sp = SamplingParams.from_flat(max_tokens=max_tokens, temperature=0.0, seed=0, block_size=1, speculative=False)
    t = time.perf_counter()
    outs = llm.generate(ids, sp)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="auto", help="auto | fp16 | int8 | int4 (names the result file)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16, help="batch slots (max_batch_size)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=300, help="prompt length of the prefill timing (0: none)")
    ap.add_argument("--compare-plain-attention", action="store_true",
                    help="also measure with row-invariant attention off (the one-call SDPA)")
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)

    from unmask.cli.serve import default_model
    from unmask.engine import LLM
    from unmask.engine.model import load_model

    path, _, what = default_model()
    model = load_model(path, weights=args.weights)
    llm = LLM(model, max_batch_size=args.batch)
    ids = [llm.apply_chat_template([{"role": "user", "content": p["prompt"]}]) for p in bc.grid_prompts(args.prompts)]
    fused = model.decoder_forward
    def run() -> dict:
        r = measure(llm, ids, args.max_tokens)
        if args.prefill_tokens:
            r["prefill_ms"] = prefill_ms(llm, args.prefill_tokens)
        r["batch_tokens_per_s"] = batch_tokens_per_s(llm, ids, args.max_tokens)
        return r

    runs = {f"row-invariant attention {'on' if fused is not None and fused.row_invariant else 'off'}": run()}
    if args.compare_plain_attention and fused is not None and fused.row_invariant:
        fused.row_invariant = False
        runs["row-invariant attention off"] = run()
        fused.row_invariant = True
    cols = ["block1_batched_equals_alone", "speculative_batched_equals_alone", "diffusion-b4-t0.5_batched_equals_alone",
            "spec_equals_block1"]
    n = len(ids)
    rows = [[name] + [f"{round(r[c] * n)}/{n}" for c in cols] + [r.get("prefill_ms", ""), r["batch_tokens_per_s"]]
            for name, r in runs.items()]
    md = (f"The served default ({what}) in `{model.weight_format}` weights, {n} held-out grid prompts, greedy, "
          f"max {args.max_tokens} tokens; batched = all prompts in one batch of {args.batch} slots.\n\n"
          + bc.markdown_table(["attention", "block 1: batched = alone", "speculative: batched = alone",
                               "diffusion b4 t0.5: batched = alone", "speculative = block 1 (alone)",
                               f"prefill of {args.prefill_tokens} tokens (ms, median of 3)",
                               f"block-1 tokens/s, all prompts in {args.batch} slots"], rows))
    data = {"benchmark": "invariance", "settings": {**vars(args), "served": what, "weights": model.weight_format},
            "environment": bc.environment(args.threads), "runs": runs}
    return bc.report(f"bench_invariance_{args.weights}", data, md)


if __name__ == "__main__":
    raise SystemExit(main())
