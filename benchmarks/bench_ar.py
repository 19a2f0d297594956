"""The diffusion engine against autoregressive decoding of the parent model (issue 6, benchmark 3).

Same prompts (chat template), same run, batch 1, greedy, stopping at EOS (tokens counted up to and including it):

* ``hf_greedy``: transformers ``generate(do_sample=False)`` with its KV cache on the prefix-causal checkpoint's
  weights loaded as a plain causal LM - the parent's weights plus the one added mask row (which only widens the
  LM head by one row).
* ``engine_block1``: the engine at ``block_size=1`` with the exact cache: the same computation as AR decoding
  (DESIGN.md section 4), through the general decoding loop; its tokens must equal ``hf_greedy``'s.
* ``engine_parallel``: the engine at a parallel setting (``--parallel-block``, ``--threshold``, exact cache), on
  ``--parallel-model`` (default: the same model; a trained A2D model is what makes parallel decoding accurate).
  Quality: token agreement with the parent's greedy answer (position-wise, over the parent's length).

llama.cpp (``llama-cpp-python``) is measured when importable; PyPI has no binary wheel for this platform and a
source build did not fit this session, so it is reported as not measured otherwise.

    .venv/bin/python benchmarks/bench_ar.py --max-tokens 48 --repeats 2
"""
from __future__ import annotations

import argparse
import time

import torch

import bench_common as bc

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for staying healthy.",
    "Explain what a rainbow is to a child.",
]


@torch.inference_mode()
def hf_greedy(model, prompt_ids, max_tokens, eos_ids):
    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         use_cache=True, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    sec = time.perf_counter() - t0
    gen = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(gen):
        if t in eos_ids:
            gen = gen[: i + 1]
            break
    return sec, gen


def engine_run(llm, prompt_ids, params):
    t0 = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0].outputs[0]
    return time.perf_counter() - t0, out.token_ids, out.nfe


def agreement(a: list[int], ref: list[int]) -> float:
    """Fraction of the reference's positions where ``a`` has the same token."""
    if not ref:
        return 1.0
    return sum(1 for i, t in enumerate(ref) if i < len(a) and a[i] == t) / len(ref)


def try_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return llama_cpp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--parallel-model", default=None, help="model for the parallel setting (default: --model)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parallel-block", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from unmask.engine import LLM, SamplingParams

    lm = bc.real_model(args.model)
    llm = LLM(lm, max_batch_size=1)
    par_llm = llm if args.parallel_model is None else LLM(bc.real_model(args.parallel_model), max_batch_size=1)
    hf = AutoModelForCausalLM.from_pretrained(lm.path, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = list(lm.dllm.eos_token_ids)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    env = bc.environment(args.threads)
    env["llama_cpp"] = "not installed: PyPI has no llama-cpp-python wheel for this platform (source build skipped)"
    p_block1 = SamplingParams(max_tokens=args.max_tokens, block_size=1, temperature=0, seed=0)
    p_par = SamplingParams(max_tokens=args.max_tokens, block_size=args.parallel_block, threshold=args.threshold,
                           temperature=0, seed=0)
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
    base = summ["hf_greedy"]["tokens_per_s"]
    for s in summ.values():
        s["ratio_vs_hf"] = s["tokens_per_s"] / base
    data = {"benchmark": "ar",
            "settings": {"model": lm.path, "parallel_model": par_llm.model.path, "prompts": PROMPTS,
                         "max_tokens": args.max_tokens, "repeats": args.repeats, "batch": 1, "temperature": 0,
                         "block1": {"block_size": 1, "cache": "auto (exact)"},
                         "parallel": {"block_size": args.parallel_block, "threshold": args.threshold,
                                      "cache": "auto (exact)"},
                         "hf": "transformers generate, do_sample=False, use_cache=True, sdpa"},
            "environment": env, "summary": summ, "runs": runs, "llama_cpp": None}
    names = {"hf_greedy": "transformers greedy (KV cache)", "engine_block1": "engine, block 1 (= AR)",
             "engine_parallel": f"engine, block {args.parallel_block}, threshold {args.threshold}"}
    rows = [[names[k], s["tokens_per_s"], f"{s['ratio_vs_hf']:.2f}x", s["tpf"], s["agreement_with_parent"],
             "" if s["identical_to_parent"] is None else ("yes" if s["identical_to_parent"] else "no")]
            for k, s in summ.items()]
    rows.append(["llama.cpp (same GGUF)", "not measured", "", "", "", "no PyPI wheel; source build skipped"])
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
        fig.tight_layout()
        fig.savefig(path, dpi=100)

    print(md)
    print("wrote", bc.write_results("bench_ar", data, md, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
