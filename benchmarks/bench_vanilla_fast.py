"""The published vanilla algorithm against the engine's fast configuration on the trained model (issue 6,
benchmark 2; target: >= 10x tokens/s at no worse accuracy).

Vanilla = LLaDA's ``generate()`` recipe run by this engine: no KV cache, quota mode with ``low_confidence``
remasking, block 32, ``steps = max_tokens`` (one token per step), ``max_tokens`` 256. Fast = the KV cache
(``cache=auto``: exact for the prefix-causal A2D model) with confidence-threshold parallel decoding, at the
checkpoint's trained block size and at block 32. Both stop at EOS once the block holding it is complete (the
engine's rule; the published code always fills the whole canvas, so this vanilla is the charitable baseline) and
both run on the *same* prompts in the *same* process as the AR parent (transformers greedy), through the quality
harness (``eval_quality.py``), which scores every output with the real-model measures: answer accuracy, token F1
against the parent, generative perplexity under the parent, repetition, distinct-2, EOS rate; and times
``--speed-prompts`` of them at batch 1 (the ratio below uses the medians of per-prompt tokens/s).

    .venv/bin/python benchmarks/bench_vanilla_fast.py --model ~/.cache/unmask/recipes/smollm2/train/checkpoint-N

Writes the harness files into ``results/bench_vanilla_fast/`` and the summary ``results/bench_vanilla_fast.{json,md}``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import bench_common as bc
import eval_quality as ev

VANILLA = "b32-s{n}-cache-none"


def default_model() -> str | None:
    """The recipe's latest fp32 training checkpoint, when there is one."""
    from unmask.training.recipes.smollm2 import trained_fp32_checkpoint

    ckpt = trained_fp32_checkpoint()
    return str(ckpt) if ckpt else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="trained checkpoint (default: the recipe's latest fp32 one)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--fast", nargs="+", default=["b4-t0.9", "b32-t0.9"],
                    help="fast settings (cache auto); quality harness syntax")
    ap.add_argument("--prompts", type=int, default=12, help="first N prompts of the fixed 60-prompt grid subset")
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    bc.add_weights_argument(ap)
    args = ap.parse_args(argv)
    model = args.model or default_model()
    if not model or not Path(model).expanduser().is_dir():
        print(f"bench_vanilla_fast: error: --model: no trained checkpoint ({model or 'none found'}); run "
              "`unmask recipe` or pass --model", file=sys.stderr)
        return 2
    bc.set_threads(args.threads)
    env = bc.environment(args.threads)
    vanilla = VANILLA.format(n=args.max_tokens)
    result = bc.result_name("bench_vanilla_fast")
    out_dir = bc.RESULTS / result
    eargs = ev.add_arguments(argparse.ArgumentParser()).parse_args([
        "--no-defaults", "--model", f"trained={model}", "--grid", vanilla, *args.fast,
        "--grid-prompts", str(args.prompts), "--speed-prompts", str(args.speed_prompts),
        "--max-tokens", str(args.max_tokens), "--skip-full", "--out", str(out_dir), "--overwrite",
        "--weights", args.weights])
    eargs.command_line = bc.command_line()
    result = ev.run_eval(eargs)
    runs = {r["setting"] if r["model"] != "parent" else "parent": r for r in result["runs"] if r["subset"] == "grid"}
    base = runs[vanilla]["tokens_per_s_b1_median"]
    header = ["setting", "cache", "TPF", "NFE", "tok/s b=1 (median)", "x vanilla", "answer acc", "F1 vs parent",
              "gen PPL", "rep-3", "distinct-2", "EOS"]
    rows = []
    for name, r in runs.items():
        cache = "-" if name == "parent" else ev.parse_setting(name).cache
        tps = r.get("tokens_per_s_b1_median")
        rows.append([name if name != "parent" else "AR parent (transformers greedy)", cache, r["tpf"], r["nfe_mean"],
                     tps, (tps / base) if tps and base else None, r["answer_acc"], r["token_f1_vs_parent"],
                     r["gen_ppl"], r["rep3"], r["distinct2"], r["eos_rate"]])
    md = (f"Model `{model}`, {args.prompts} prompts of the 60-prompt grid subset (answer accuracy on the checkable "
          f"ones), greedy, <= {args.max_tokens} new tokens; speed = median over {args.speed_prompts} prompts at "
          f"batch 1. Harness files: `{result}/`.\n\n" + bc.markdown_table(header, rows))
    data = {"settings": {"model": model, "vanilla": vanilla, "fast": args.fast, "max_tokens": args.max_tokens,
                         "prompts": args.prompts, "speed_prompts": args.speed_prompts},
            "environment": env, "runs": runs,
            "speedup_vs_vanilla": {n: (r["tokens_per_s_b1_median"] / base) if base else None
                                   for n, r in runs.items() if n != "parent"}}
    bc.write_results(result, data, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
