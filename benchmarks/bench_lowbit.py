"""The engine's block-1 decoding of the real model with fp16-packed, int8 and int4 weights (issue 25, low-bit CPU
kernels; engine/lowbit.py).

Same prompts (chat template), batch 1, greedy, ``max_tokens`` per answer, stopping at EOS; per format: tokens/s
(median over prompts x repeats), tokens/forward (1 at block 1), the fraction of answers identical to the fp16
format's and the position-wise token agreement with it, and the relative error of one prompt's logits against the
float32 (``native``) model. Also one layer's kernel time (576 -> 1536, the SmolLM2 MLP up-projection shape) at 1 and
4 rows for each kernel, with float32 and bfloat16 activations (why the low-bit layers round activations to bf16).

    nice -n 10 .venv/bin/python benchmarks/bench_lowbit.py --max-tokens 24 --repeats 3
"""
from __future__ import annotations

import argparse
import time

import torch

import bench_common as bc
from bench_ar import PROMPTS, agreement, engine_run

FORMATS = ("fp16", "int8", "int4")


def kernel_times(rows: int, n: int = 1536, k: int = 576, calls: int = 400) -> dict:
    """Microseconds per call of each kernel on one ``[n, k]`` layer with ``rows`` input rows."""
    from unmask.engine.lowbit import LowbitLinear
    from unmask.engine.packed_weights import PackedFp16Linear

    torch.manual_seed(0)
    w = torch.randn(n, k) / k ** 0.5
    lin8, lin4, fp16 = LowbitLinear(w, None, 8), LowbitLinear(w, None, 4), PackedFp16Linear(w, None)
    x = torch.randn(rows, k)
    xb = x.to(torch.bfloat16)
    cases = {
        "fp32_mkl": lambda: x @ w.T,
        "fp16_fbgemm": lambda: fp16(x),
        "int8_bf16_act": lambda: torch.ops.aten._weight_int8pack_mm(xb, lin8.qweight, lin8.scales),
        "int8_fp32_act": lambda: torch.ops.aten._weight_int8pack_mm(x, lin8.qweight, lin8.scales.float()),
        "int4_bf16_act": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, lin4.qweight, 32, lin4.scales),
        "int4_fp32_act": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin4.qweight, 32, lin4.scales.float()),
        "int8_layer": lambda: lin8(x),
        "int4_layer": lambda: lin4(x),
    }
    out = {}
    with torch.inference_mode():
        for name, f in cases.items():
            for _ in range(20):
                f()
            reps = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls if "fp32_act" not in name else calls // 8):
                    f()
                reps.append((time.perf_counter() - t0) / (calls if "fp32_act" not in name else calls // 8) * 1e6)
            out[name] = bc.median(reps)
    return out


@torch.inference_mode()
def logits_of(lm, ids: list[int]) -> torch.Tensor:
    t = torch.tensor([ids])
    return lm.logits(lm.hidden_states(t, torch.arange(len(ids))[None], None)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.lowbit import lowbit_unavailable

    env = bc.environment(args.threads)
    env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    env["lowbit_unavailable"] = {f: lowbit_unavailable(f, torch.device("cpu"), torch.float32) for f in ("int8", "int4")}
    kernels = {str(r): kernel_times(r) for r in (1, 4)}
    native = bc.real_model(args.model, weights="native")
    llm0 = LLM(native, max_batch_size=1)
    prompts = [llm0.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ref_logits = logits_of(native, prompts[0])
    del llm0, native
    params = SamplingParams(max_tokens=args.max_tokens, block_size=1, temperature=0, seed=0, speculative=False)
    runs, answers, errors, llms = {}, {}, {}, {}
    for fmt in FORMATS:
        lm = bc.real_model(args.model, weights=fmt)
        assert lm.weight_format == fmt, (fmt, lm.weight_format)
        lg = logits_of(lm, prompts[0])
        errors[fmt] = {"logits_rel_err_vs_fp32": float((lg - ref_logits).norm() / ref_logits.norm()),
                       "argmax_agreement_vs_fp32": float((lg.argmax(-1) == ref_logits.argmax(-1)).float().mean())}
        llms[fmt] = LLM(lm, max_batch_size=1)
        engine_run(llms[fmt], prompts[0][:8], SamplingParams(max_tokens=4, block_size=1, temperature=0))  # warm-up
        runs[fmt], answers[fmt] = [], {}
    # formats interleaved per (repeat, prompt): a shared machine's load drifts over minutes
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for fmt in FORMATS:
                sec, toks, nfe = engine_run(llms[fmt], ids, params)
                answers[fmt][i] = toks
                runs[fmt].append({"prompt": i, "repeat": rep, "seconds": sec, "tokens": len(toks), "nfe": nfe,
                                  "tokens_per_s": len(toks) / sec})
                print(fmt, rep, i, runs[fmt][-1], flush=True)
    summary = {}
    for fmt in FORMATS:
        rs = runs[fmt]
        summary[fmt] = {
            "tokens_per_s_median": bc.median([r["tokens_per_s"] for r in rs]),
            "tokens_per_forward": sum(r["tokens"] for r in rs) / max(1, sum(r["nfe"] for r in rs)),
            # per (repeat, prompt) pair, the format's rate over fp16's measured right before it (drift cancels)
            "x_fp16_paired_median": bc.median([r["tokens_per_s"] / f["tokens_per_s"] for r, f in zip(rs, runs["fp16"])]),
            "identical_to_fp16": sum(answers[fmt][i] == answers["fp16"][i] for i in answers[fmt]) / len(prompts),
            "agreement_with_fp16": sum(agreement(answers[fmt][i], answers["fp16"][i]) for i in answers[fmt])
            / len(prompts),
            **errors[fmt]}
    rows = [[f, s["tokens_per_s_median"], s["x_fp16_paired_median"], s["tokens_per_forward"],
             s["identical_to_fp16"], s["agreement_with_fp16"], s["logits_rel_err_vs_fp32"],
             s["argmax_agreement_vs_fp32"]] for f, s in summary.items()]
    md = bc.markdown_table(["weights", "tok/s (median)", "x fp16 (paired median)", "tokens/forward", "answers = fp16",
                            "token agreement", "logits rel. err vs fp32", "argmax = fp32"], rows)
    md += "\n\nOne layer (576 -> 1536), microseconds per call:\n\n"
    md += bc.markdown_table(["kernel", "1 row", "4 rows"], [[k, kernels["1"][k], kernels["4"][k]] for k in kernels["1"]])
    return bc.report("bench_lowbit", {"environment": env, "summary": summary, "kernels_us": kernels, "runs": runs,
                                      "settings": vars(args)}, md)


if __name__ == "__main__":
    raise SystemExit(main())
