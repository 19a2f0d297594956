"""Where a block-1 decoding step's time goes on a CPU: the weight GEMMs' floor against everything else (issue 25,
target "engine block 1 >= 0.5x llama.cpp").

Measured in one process, on the parent in fp16-packed weights (the served default's format), batch 1:

* ``read bandwidth``: a float32 sum over 268 MB (GB/s): what the memory system delivers to these threads;
* ``GEMMs alone``: the model's own packed projections (every layer's fused q|k|v, o, gate|up, down and the LM head,
  in forward order, one row each) called back to back, nothing else: the least a step of this weight format costs
  (ms, and the GB/s its weight bytes imply);
* ``engine step``: a generation-only step (``llama-bench`` tg's quantity: n + 1 generated tokens minus 1, EOS
  ignored, prefill not counted) through ``LLM.generate``;
* ``overhead``: the same generation with every packed projection replaced by a cached output of the right shape
  (the GEMMs cost ~0), i.e. the step's time outside its weight GEMMs: norms, RoPE, attention, KV cache, sampling,
  scheduling (ms per step; the tokens decoded this way are meaningless and not reported).

Then ``engine step ~= GEMMs alone + overhead`` tells how far a format can go: a step that did nothing but its GEMMs
would run at ``1000 / GEMMs`` tokens/s. Medians over ``--repeats``.

    .venv/bin/python benchmarks/bench_step_anatomy.py --threads 2 --repeats 5
"""
from __future__ import annotations

import argparse
import time

import bench_common as bc


def packed_linears(model) -> list:
    """The packed projections of a loaded fp16 model in forward order (per layer q|k|v, o, gate|up, down; then the
    LM head), as ``(name, module)``."""
    from unmask.engine.packed_weights import PackedFp16Linear

    mods = [(n, m) for n, m in model.model.named_modules() if isinstance(m, PackedFp16Linear)]
    if not mods:
        raise SystemExit("bench_step_anatomy: the model has no fp16-packed layers (fbgemm missing?)")
    return mods


def gemms_alone(mods: list, repeats: int) -> float:
    """Median seconds of one pass of every module in ``mods`` on one float32 row."""
    import torch

    xs = [torch.randn(1, m.in_features) for _, m in mods]
    calls = [m.as_function() for _, m in mods]

    def one() -> float:
        t = time.perf_counter()
        for f, x in zip(calls, xs):
            f(x)
        return time.perf_counter() - t

    one()
    return bc.median([one() for _ in range(repeats)])


def read_bandwidth(repeats: int) -> float:
    """GB/s of a float32 sum over 268 MB."""
    import torch

    t = torch.empty(67_000_000).normal_()
    t.sum()
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum()
        secs.append(time.perf_counter() - t0)
    return t.numel() * 4 / bc.median(secs) / 1e9


def step_seconds(llm, prompts: list[dict], n: int) -> float:
    """Seconds per generation-only step over ``prompts`` (:func:`bench_default.engine_tg`: ``n + 1`` tokens minus 1
    token each, ignore_eos)."""
    from bench_default import engine_tg

    from unmask.engine import SamplingParams

    r = engine_tg(llm, prompts, n, lambda k: SamplingParams.from_flat(
        max_tokens=k, temperature=0.0, seed=0, block_size=1, speculative=False, ignore_eos=True))
    return r["seconds"] / r["tokens"]


def fake_gemms(model, mods: list) -> None:
    """Replace every packed projection's function by a cached zero output of the right shape (in place; the
    fused decoder is rebuilt so that its per-layer plans pick the fakes up)."""
    import torch

    from unmask.engine.fused_decoder import FusedDecoder

    for _, m in mods:
        cache: dict = {}

        def fake(x, out_f=m.out_features, cache=cache):
            key = tuple(x.shape[:-1])
            if key not in cache:
                cache[key] = torch.zeros(*key, out_f)
            return cache[key]

        m.as_function = (lambda f: lambda: f)(fake)
        m.forward = fake
    model.decoder_forward = FusedDecoder(model.decoder_forward.decoder, model.decoder_forward.row_invariant)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="first N held-out grid prompts (chat template)")
    ap.add_argument("--max-tokens", type=int, default=48, help="generated tokens per prompt (tg<N>)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)

    from unmask.engine import LLM
    from unmask.engine.model import load_model
    from unmask.training.realmodel import ensure_default_converted

    parent = str(ensure_default_converted())
    model = load_model(parent, weights="fp16")
    if model.decoder_forward is None:
        raise SystemExit("bench_step_anatomy: no fused decoder for this model (fbgemm missing?)")
    llm = LLM(model, max_batch_size=1)
    prompts = bc.grid_prompts(args.prompts)
    mods = packed_linears(model)
    weight_bytes = sum(m.in_features * m.out_features * 2 for _, m in mods)
    env = bc.environment(args.threads)

    step_seconds(llm, prompts[:1], 4)  # warm-up
    bandwidth, gemm, step = [], [], []
    for _ in range(args.repeats):  # interleaved: a shared machine's load drifts
        bandwidth.append(read_bandwidth(3))
        gemm.append(gemms_alone(mods, 3))
        step.append(step_seconds(llm, prompts, args.max_tokens))
    fake_gemms(model, mods)
    step_seconds(llm, prompts[:1], 4)
    overhead = [step_seconds(llm, prompts, args.max_tokens) for _ in range(args.repeats)]

    g, s, o = bc.median(gemm) * 1e3, bc.median(step) * 1e3, bc.median(overhead) * 1e3
    summary = {"read_bandwidth_gb_s": bc.median(bandwidth), "gemm_ms": g, "gemm_gb_s": weight_bytes / g / 1e6,
               "step_ms": s, "tokens_per_s": 1e3 / s, "overhead_ms": o, "gemm_plus_overhead_ms": g + o,
               "gemm_only_tokens_per_s": 1e3 / g, "weight_bytes": weight_bytes, "projections": len(mods)}
    rows = [["read bandwidth (float32 sum, 268 MB)", f"{summary['read_bandwidth_gb_s']:.1f} GB/s", ""],
            [f"GEMMs alone ({len(mods)} fp16 projections, {weight_bytes / 1e6:.0f} MB)", f"{g:.2f} ms",
             f"{summary['gemm_gb_s']:.1f} GB/s; {summary['gemm_only_tokens_per_s']:.0f} tokens/s if a step were "
             "only these"],
            [f"engine step (tg{args.max_tokens}, block 1)", f"{s:.2f} ms", f"{summary['tokens_per_s']:.1f} tokens/s"],
            ["overhead (the same steps, GEMMs replaced by cached outputs)", f"{o:.2f} ms",
             f"GEMMs + overhead = {g + o:.2f} ms"]]
    md = (f"SmolLM2-135M parent ({parent}), fp16-packed, batch 1, {len(prompts)} grid prompts x "
          f"{args.max_tokens} generated tokens, {args.threads} thread(s), medians of {args.repeats} repeats.\n\n"
          + bc.markdown_table(["what", "median", "note"], rows))
    data = {"benchmark": "step_anatomy", "settings": {**vars(args), "parent": parent}, "environment": env,
            "summary": summary, "raw": {"read_bandwidth_gb_s": bandwidth, "gemm_s": gemm, "step_s": step,
                                        "overhead_s": overhead}}
    return bc.report("bench_step_anatomy", data, md)


if __name__ == "__main__":
    raise SystemExit(main())
