"""Issue 26's VFM trial, evaluated (docs/methods.md "VFM trial", docs/design.md#the-seeds-methods).

One- and K-step decoding of held-out prompts with the default model (the a2d conversion of SmolLM2 + the shipped
mask-row adapter) through :func:`unmask.training.experimental.vfm.decode` (an evaluation-only decoder: the answer's G
positions are one block, LLaDA's quota, greedy), in three noise modes of the trained VFM checkpoint:

* ``none``: z = 0, the plain mask embeddings (the model without VFM noise),
* ``mean``: z = mu (the adapter's prompt-conditioned mean, deterministic),
* ``sample``: z = mu + sigma * eps, one draw per prompt (seed 0), what VFM trains.

Besides, the engine decodes the same prompts with the same default model at block G with K steps (``engine``
rows; greedy, native float32 weights), which checks the ``none`` decoder against the served path, and the parent
answers at block 1 (the reference of token F1). Prompts: every 5th of the 152 checkable held-out prompts of
``benchmarks/data/eval_prompts.jsonl`` (30 of them; the rule was fixed before any run). Scoring: the project's
``quality_metrics.answer_match`` / ``exact_match`` / ``token_f1`` against the parent's answer; TPF = tokens /
forwards; 95% percentile-bootstrap intervals and paired differences against ``none`` at the same K
(``eval_methods.bootstrap_ci``).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/vfm_trial.py --vfm WORK/vfm/latest \\
        --out benchmarks/results/training/methods/vfm
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_methods as em  # noqa: E402
import eval_quality as ev  # noqa: E402
import quality_metrics as qm  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def select_prompts(data_dir: Path, every: int, count: int) -> list[dict]:
    """Every ``every``-th checkable held-out prompt, the first ``count`` of them."""
    return em.checkable_prompts(data_dir)[::every][:count]


def load_vfm(conversion: str, adapter: str, vfm_ckpt: str):
    """The VFM module over the conversion + mask-row adapter, with the noise adapter of ``vfm_ckpt``."""
    from unmask.engine.adapter_files import read_adapter
    from unmask.training.experimental import vfm
    from unmask.training.mask_adapter import initialise_from
    from unmask.training.scopes import prepare_model

    weights, _ = read_adapter(adapter)
    tm = prepare_model(conversion, "mask_lora", weights.rank, weights.alpha, list(weights.targets))
    initialise_from(tm, adapter)
    vfm.attach(tm, 1, 1)  # freezes everything; replaced by the trained adapter below
    tm.base.vfm_noise = vfm.load_adapter(vfm_ckpt)
    tm.base.eval()
    return tm, vfm.VfmForward(tm)


def records(rows, texts, nfes, tokens, parent_text) -> list[dict]:
    return [{"id": r["id"], "text": t, "tokens": n_tok, "nfe": n,
             "answer_acc": qm.answer_match(t, r["answer"]), "exact_match": qm.exact_match(t, r["answer"]),
             "token_f1": qm.token_f1(t, parent_text[r["id"]])}
            for r, t, n, n_tok in zip(rows, texts, nfes, tokens)]


def summary(recs: list[dict], ref: list[dict] | None, resamples: int) -> dict:
    out = {"n": len(recs), "tpf": round(sum(r["tokens"] for r in recs) / max(1, sum(r["nfe"] for r in recs)), 3)}
    for m in em.METRICS:
        x = [float(r[m]) for r in recs]
        out[m] = round(sum(x) / len(x), 4)
        out[f"{m}_ci"] = [round(v, 4) for v in em.bootstrap_ci(x, resamples=resamples)]
        if ref is not None:
            y = [float(r[m]) for r in ref]
            out[f"{m}_diff_vs_none"] = round(sum(x) / len(x) - sum(y) / len(y), 4)
            out[f"{m}_diff_ci"] = [round(v, 4) for v in em.bootstrap_ci(x, y, resamples=resamples)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vfm", required=True, help="the VFM training run's checkpoint (or its --out with `latest`)")
    p.add_argument("--conversion", default=None, help="the a2d conversion (default: ensure_default_converted())")
    p.add_argument("--adapter", default=None, help="the mask-row adapter (default: the shipped one's copy)")
    p.add_argument("--data", default=str(REPO / "benchmarks" / "data"))
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--count", type=int, default=30)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--steps", default="1,4,8")
    p.add_argument("--resamples", type=int, default=10000)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "training" / "methods" / "vfm"))
    a = p.parse_args(argv)

    import torch

    from unmask.engine import LLM, SamplingParams
    from unmask.training.experimental import vfm
    from unmask.training.realmodel import ensure_default_converted

    conversion = a.conversion or str(ensure_default_converted())
    adapter = a.adapter or str(Path(conversion).parent / "smollm2-135m-a2d-mask-adapter")
    ckpt = Path(a.vfm).expanduser()
    if (ckpt / "latest").is_file():
        ckpt = ckpt / (ckpt / "latest").read_text().strip()
    rows = select_prompts(Path(a.data), a.every, a.count)
    steps = [int(s) for s in a.steps.split(",")]
    G = a.gen_len
    t0 = time.time()
    timing = {}

    parent = LLM(conversion, weights="native")
    prompts = [parent.apply_chat_template(ev.chat_messages(r)) for r in rows]
    tok = parent.model.tokenizer
    eos = set(parent.model.dllm.eos_token_ids)
    res = parent.generate(prompts, SamplingParams(max_tokens=G, temperature=0.0, block_size=1))
    parent_text = {r["id"]: ro.outputs[0].text for r, ro in zip(rows, res)}
    raw = {"parent b1": records(rows, [ro.outputs[0].text for ro in res], [ro.outputs[0].nfe for ro in res],
                                [len(ro.outputs[0].token_ids) for ro in res], parent_text)}
    del parent
    timing["parent"] = round(time.time() - t0, 1)

    eng = LLM(adapter, weights="native")
    for k in steps:
        t1 = time.time()
        res = eng.generate(prompts, SamplingParams(max_tokens=G, temperature=0.0, block_size=G, steps=k,
                                                   speculative=False))
        raw[f"engine plain K={k}"] = records(rows, [ro.outputs[0].text for ro in res],
                                             [ro.outputs[0].nfe for ro in res],
                                             [len(ro.outputs[0].token_ids) for ro in res], parent_text)
        timing[f"engine K={k}"] = round(time.time() - t1, 1)
    del eng

    tm, mod = load_vfm(conversion, adapter, str(ckpt))
    d = tm.dllm
    ids = [list(pr) if not isinstance(pr, str) else list(tok(pr, add_special_tokens=False).input_ids)
           for pr in prompts]
    for k in steps:
        for mode in ("none", "mean", "sample"):
            t1 = time.time()
            with torch.no_grad():
                outs = vfm.decode(mod, ids, G, k, mode, d.mask_token_id, d.pad_token_id, eos, seed=0)
            texts = [tok.decode([t for t in o["ids"] if t not in eos], skip_special_tokens=True) for o in outs]
            raw[f"vfm {mode} K={k}"] = records(rows, texts, [o["nfe"] for o in outs], [len(o["ids"]) for o in outs],
                                               parent_text)
            timing[f"vfm {mode} K={k}"] = round(time.time() - t1, 1)

    result = {"prompts": [r["id"] for r in rows], "gen_len": G, "vfm_checkpoint": str(ckpt),
              "conversion": conversion, "adapter": adapter, "timing_s": timing,
              "vfm_training": json.loads((ckpt / vfm.CONFIG_FILE).read_text()).get("training"), "runs": {}}
    for name, recs in raw.items():
        ref = None
        if name.startswith("vfm ") and not name.startswith("vfm none"):
            ref = raw[f"vfm none K={name.rsplit('=', 1)[1]}"]
        result["runs"][name] = summary(recs, ref, a.resamples)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vfm_trial.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "vfm_trial_samples.json").write_text(json.dumps(raw, indent=1, ensure_ascii=False) + "\n")
    (out / "vfm_trial.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [f"# VFM trial: {len(result['prompts'])} held-out prompts, {result['gen_len']} answer positions",
             "", f"VFM checkpoint: `{Path(result['vfm_checkpoint']).name}`; training: "
             f"`{json.dumps(result.get('vfm_training'))}`", "",
             "| run | TPF | answer acc [95% CI] | exact | token F1 vs parent | acc diff vs none [95% CI] | "
             "F1 diff vs none [95% CI] |", "|---|---|---|---|---|---|---|"]
    for name, s in result["runs"].items():
        acc = f"{s['answer_acc']:.3f} [{s['answer_acc_ci'][0]:.3f}, {s['answer_acc_ci'][1]:.3f}]"
        d_acc = d_f1 = ""
        if "answer_acc_diff_vs_none" in s:
            d_acc = (f"{s['answer_acc_diff_vs_none']:+.3f} [{s['answer_acc_diff_ci'][0]:+.3f}, "
                     f"{s['answer_acc_diff_ci'][1]:+.3f}]")
            d_f1 = f"{s['token_f1_diff_vs_none']:+.3f} [{s['token_f1_diff_ci'][0]:+.3f}, {s['token_f1_diff_ci'][1]:+.3f}]"
        lines.append(f"| {name} | {s['tpf']:.2f} | {acc} | {s['exact_match']:.3f} | {s['token_f1']:.3f} | {d_acc} | "
                     f"{d_f1} |")
    lines += ["", f"Wall seconds per run: `{json.dumps(result['timing_s'])}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
