"""Lane attention's batched calls against one call per lane (``engine/lane_attention.py``; issue 42), paired in one
process: the tiny bidirectional model of ``benchmarks/bench_vs_reference.py`` with Fast-dLLM's prefix cache (the
engine's lane mode), its prompts, settings and token check, and in each repeat three timed runs in turn: the engine
with lanes grouped (one SDPA call per group of alike lanes over a strided view of the KV pool), the engine with every
lane attended alone (``_batch_invariant_sdpa`` patched to False: the path before grouping), and the frozen reference
loop (each side first in turn). Both engine runs must give the reference's tokens. Medians; ratios within the same
run (and of the fastest runs: a shared machine's load comes in bursts). First, one layer's attention at the tiny
model's and 8B-like shapes three ways (:func:`kernels`): per lane, a strided view of the slab, the lanes' keys
stacked into one tensor (a gather).

    .venv/bin/python benchmarks/bench_lane_groups.py [--repeats 7] [--batch 1 8 32]

Writes ``benchmarks/results/bench_lane_groups.{json,md}``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import bench_common as bc  # noqa: E402
import bench_vs_reference as bvr  # noqa: E402
from reference_loop import ReferenceConfig, reference_generate  # noqa: E402

MODEL = "tiny-bidirectional"


def measure(llm, model, prompts, cfg: ReferenceConfig, repeats: int, label: str) -> dict:
    """Same tokens on every side, then ``repeats`` rounds of grouped / per lane / reference timed runs."""
    from unmask.engine import SamplingParams, lane_attention

    params = SamplingParams.from_flat(temperature=0, speculative=False, block_size=cfg.block_size, steps=cfg.steps,
                                      threshold=cfg.threshold, cache=cfg.cache, ignore_eos=True,
                                      max_tokens=cfg.max_tokens)
    ids = prompts.tolist()
    grouped_sdpa = lane_attention._batch_invariant_sdpa

    def engine(grouped: bool):
        lane_attention._batch_invariant_sdpa = grouped_sdpa if grouped else (lambda query: False)
        try:
            return llm.generate(ids, params)
        finally:
            lane_attention._batch_invariant_sdpa = grouped_sdpa

    ref = reference_generate(model, prompts, cfg).tolist()
    for grouped in (True, False):
        for lane, out in enumerate(engine(grouped)):
            if out.outputs[0].token_ids != ref[lane]:
                raise AssertionError(f"{label} (grouped={grouped}): lane {lane}: tokens differ from the reference")
    times: dict[str, list[float]] = {"grouped": [], "per_lane": [], "reference": []}
    sides = [("grouped", lambda: engine(True)), ("per_lane", lambda: engine(False)),
             ("reference", lambda: reference_generate(model, prompts, cfg))]
    for i in range(repeats):
        for name, run in sides[i % 3:] + sides[:i % 3]:  # each side first in turn (no order bias)
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    tokens = prompts.shape[0] * cfg.max_tokens
    med = {k: bc.median(v) for k, v in times.items()}
    return {"seconds": times, "median_s": med, "tok_s": {k: tokens / v for k, v in med.items()},
            "grouped_vs_per_lane": med["per_lane"] / med["grouped"],
            "grouped_vs_reference": med["reference"] / med["grouped"],
            "per_lane_vs_reference": med["reference"] / med["per_lane"], "same_tokens": True,
            "grouped_vs_per_lane_fastest": min(times["per_lane"]) / min(times["grouped"])}


#: (lanes, query heads, KV heads, head dim, cached keys, chunk rows, masked): the tiny model's prefix-cache steps and
#: 8B-like layers (LLaMA-3-8B's heads) decoding 1,024 cached keys / a 200-row chunk over 600
SHAPES = ((8, 4, 2, 16, 24, 24, False), (32, 4, 2, 16, 40, 8, True), (16, 32, 8, 128, 1024, 32, False),
          (8, 32, 8, 128, 600, 200, True))


def kernels(dtype_name: str, repeats: int) -> list[dict]:
    """One layer's attention over lanes evenly spaced in one slab, three ways: one SDPA call per lane (the path
    before grouping), one call over a strided view of the slab (grouped), one call over the lanes' keys stacked
    into one tensor (a gather: a copy of every lane's cache). Medians of ``repeats`` timings of 5 calls each; the
    outputs must be equal bit for bit. The ways take turns within each repeat."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    out = []
    g = torch.Generator().manual_seed(0)
    for B, Hq, Hkv, D, n, q, masked in SHAPES:
        L, stride = n + q, n + q + 16  # each lane's run, then 16 free slots before the next lane's
        ks, vs = (torch.randn(Hkv, B * stride, D, generator=g).to(dtype) for _ in range(2))
        query = torch.randn(B, q, Hq, D, generator=g).to(dtype).transpose(1, 2)
        mask = torch.rand(B, 1, q, L, generator=g) < 0.7 if masked else None
        gqa = Hq != Hkv

        def per_lane():
            o = query.new_zeros(B, q, Hq, D)
            for b in range(B):
                k, v = ks[:, b * stride:b * stride + L], vs[:, b * stride:b * stride + L]
                o[b] = F.scaled_dot_product_attention(query[b][None], k[None], v[None], enable_gqa=gqa,
                                                      attn_mask=None if mask is None else mask[b:b + 1])[0].transpose(0, 1)
            return o

        def strided():
            k = ks.as_strided((B, Hkv, L, D), (stride * D, ks.stride(0), D, 1))
            v = vs.as_strided((B, Hkv, L, D), (stride * D, vs.stride(0), D, 1))
            return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)

        def stacked():
            k = torch.stack([ks[:, b * stride:b * stride + L] for b in range(B)])
            v = torch.stack([vs[:, b * stride:b * stride + L] for b in range(B)])
            return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)

        ways = {"per_lane": per_lane, "strided": strided, "stacked": stacked}
        want = per_lane()
        same = all(torch.equal(want, f()) for f in ways.values())
        ts: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats):  # the ways in turn (a shared machine's load moves)
            for name, f in ways.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    f()
                ts[name].append((time.perf_counter() - t0) / 5)
        med = {name: bc.median(t) for name, t in ts.items()}
        out.append({"dtype": dtype_name, "lanes": B, "heads": f"{Hq}/{Hkv}", "head_dim": D, "cached": n, "rows": q,
                    "masked": masked, "median_us": {k: v * 1e6 for k, v in med.items()}, "bit_equal": same,
                    "stacked_copy_bytes": 2 * B * Hkv * L * D * ks.element_size()})
        print(f"{dtype_name} {B} lanes {Hq}/{Hkv}x{D} n={n} q={q}: " + ", ".join(
            f"{k} {v * 1e6:.0f} us" for k, v in med.items()) + f", equal {same}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel-repeats", type=int, default=7, help="timings per way and shape of one layer's attention")
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    env = bc.environment(args.threads)
    from unmask.engine import LLM

    kernel_rows = [r for dt in ("float32", "bfloat16") for r in kernels(dt, args.kernel_repeats)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, setting, make_prompts = bvr.load(MODEL, Path(tmp) / MODEL)
        llm = LLM(model, max_batch_size=max(args.batch))
        for mode, steps, threshold in setting.modes:
            cfg = ReferenceConfig(setting.max_tokens, setting.block_size, steps, threshold, "prefix")
            for b in args.batch:
                label = f"{MODEL} {mode} cache prefix batch {b}"
                r = measure(llm, model, make_prompts(model, b, setting.prompt_len), cfg, args.repeats, label)
                r.update(mode=mode, batch=b, steps=steps, threshold=threshold, prompt_len=setting.prompt_len,
                         max_tokens=setting.max_tokens, block_size=setting.block_size)
                rows.append(r)
                print(f"{label:44s} grouped {r['tok_s']['grouped']:8.0f}  per lane {r['tok_s']['per_lane']:8.0f}  "
                      f"reference {r['tok_s']['reference']:8.0f} tok/s  grouped/per-lane "
                      f"{r['grouped_vs_per_lane']:.3f}", flush=True)
    header = ["mode", "batch", "grouped tok/s", "per lane tok/s", "reference tok/s", "grouped / per lane",
              "grouped / per lane, fastest runs", "grouped / reference", "per lane / reference"]
    table = [[r["mode"], r["batch"], r["tok_s"]["grouped"], r["tok_s"]["per_lane"], r["tok_s"]["reference"],
              r["grouped_vs_per_lane"], r["grouped_vs_per_lane_fastest"], r["grouped_vs_reference"],
              r["per_lane_vs_reference"]] for r in rows]
    md = (f"Lane attention grouped vs one call per lane, {MODEL} (`benchmarks/bench_vs_reference.py`'s model, prompts "
          f"and settings: P {setting.prompt_len}, {setting.max_tokens} tokens, block {setting.block_size}), Fast-dLLM "
          f"prefix cache, native float32, greedy, ignore_eos; same tokens on all three sides (checked); medians of "
          f"{args.repeats} rounds, each timing grouped, per lane and the reference (each first in turn).\n\n"
          + bc.markdown_table(header, table))
    kheader = ["dtype", "lanes", "heads q/kv x dim", "cached / rows", "masked", "per lane us", "strided view us",
               "stacked copy us", "stacked copy bytes", "bit equal"]
    ktable = [[r["dtype"], r["lanes"], f"{r['heads']} x {r['head_dim']}", f"{r['cached']} / {r['rows']}", r["masked"],
               r["median_us"]["per_lane"], r["median_us"]["strided"], r["median_us"]["stacked"],
               r["stacked_copy_bytes"], "yes" if r["bit_equal"] else "NO"] for r in kernel_rows]
    md += ("\nOne layer's attention over lanes evenly spaced in one slab (medians of "
           f"{args.kernel_repeats} x 5 calls): one SDPA call per lane, one over a strided view of the slab (what "
           "grouping does), one over the lanes' keys stacked into one tensor (a gather: a copy of every lane's "
           "cache per layer per step); outputs compared bit for bit with the per-lane calls.\n\n"
           + bc.markdown_table(kheader, ktable))
    data = {"settings": {"model": MODEL, "batch": args.batch, "repeats": args.repeats, "cache": "prefix",
                         "kernel_repeats": args.kernel_repeats},
            "environment": env, "rows": rows, "kernels": kernel_rows}
    return bc.report("bench_lane_groups", data, md)


if __name__ == "__main__":
    bc.run_script(main)
