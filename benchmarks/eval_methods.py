"""Issue 26's evaluation: answer accuracy and token F1 against TPF on the whole checkable held-out set, with 95%
paired-bootstrap intervals, for several checkpoints (docs/methods.md "Results", docs/design.md#measuring).

For every ``--model NAME=PATH`` and every decoding setting (``--settings``; the ``eval_quality`` setting syntax:
``b1-s64`` = one token per step, the reference; ``b4-t0.9`` threshold; ``b4-s32`` quota; ``-mb0.5`` multi-block
decoding) all checkable prompts of ``benchmarks/data/eval_prompts.jsonl`` (152, fixed before any model ran) are
decoded greedily in one batched ``LLM.generate`` call (the engine is batch-invariant). Per prompt: the extracted
answer accuracy (``quality_metrics.answer_match``; strict exact match beside it), token F1 against the parent's
greedy answer, tokens and forwards. The parent's answers come from ``--parent`` at block 1 (the a2d conversion at
block 1 decodes exactly the AR parent, docs/design.md#the-real-model), so no transformers copy is loaded.

Statistics (``scipy.stats.bootstrap``, percentile intervals, ``--resamples`` resamples, fixed seed): per run the
mean with its 95% interval over prompts, and the paired difference against the reference run (``--base`` model at
``--reference`` setting), resampling prompts jointly (``paired=True``). TPF = generated tokens / forwards summed
over the run.

Targets (issue 26), pass/fail in the JSON and Markdown:

1. :func:`tpf_target`: per model the largest TPF among its settings whose accuracy (point estimate) is still
   inside the base's one-token-per-step 95% interval or above it, divided by the same quantity of the base; pass
   at >= 1.5.
2. the alignment-minutes ratio, read off the training curves of ``benchmarks/methods_runs.py``
   (``--training-runs runs.json``; :func:`methods_runs.alignment_target`); pass at <= 0.5.

Resumable: every finished (model, setting) run is appended to ``eval_methods_samples.jsonl`` in ``--out`` and
read back by a rerun with the same prompts and ``--max-tokens`` (a changed checkpoint path re-decodes).

Usage::

    OMP_NUM_THREADS=2 python benchmarks/eval_methods.py --model base=WORK/base/latest --model align=WORK/align/latest \\
        --training-runs benchmarks/results/training/methods/budget/runs.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import eval_quality as ev  # noqa: E402
import methods_runs as mr  # noqa: E402
import quality_metrics as qm  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "eval" / "methods"
DEFAULT_SETTINGS = ["b1-s64", "b4-s32", "b4-s16", "b4-t0.95", "b4-t0.9", "b4-t0.8", "b4-t0.7", "b4-t0.5",
                    "b4-s64-mb0.5", "b4-s32-mb0.5", "b4-t0.9-mb0.5", "b4-t0.7-mb0.5"]
REFERENCE = "b1-s64"
METRICS = ("answer_acc", "exact_match", "token_f1")
TPF_RATIO_MIN = 1.5


# ---------------------------------------------------------------------------------------------------- statistics
def bootstrap_ci(x, y=None, resamples: int = 10000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(x)`` or, with ``y``, of the paired difference ``mean(x) - mean(y)``
    (prompts resampled jointly: ``scipy.stats.bootstrap(..., paired=True)``). ``x``/``y``: per-prompt values,
    equal lengths. A sample without spread gives the point itself (scipy refuses degenerate data).

    Raises:
        ValueError: empty input or unequal lengths.
    """
    import numpy as np
    from scipy.stats import bootstrap

    xa = np.asarray(x, dtype=np.float64)
    if xa.size == 0:
        raise ValueError("bootstrap: no values")
    if y is not None:
        ya = np.asarray(y, dtype=np.float64)
        if ya.shape != xa.shape:
            raise ValueError(f"bootstrap: paired samples of {xa.size} and {ya.size} values")
        d = xa - ya
        if np.all(d == d[0]):
            return float(d[0]), float(d[0])
        res = bootstrap((xa, ya), lambda a, b, axis: a.mean(axis=axis) - b.mean(axis=axis), paired=True,
                        vectorized=True, n_resamples=resamples, confidence_level=level, method="percentile",
                        rng=np.random.default_rng(seed))
    else:
        if np.all(xa == xa[0]):
            return float(xa[0]), float(xa[0])
        res = bootstrap((xa,), lambda a, axis: a.mean(axis=axis), vectorized=True, n_resamples=resamples,
                        confidence_level=level, method="percentile", rng=np.random.default_rng(seed))
    ci = res.confidence_interval
    return float(ci.low), float(ci.high)


def run_stats(records: list[dict], ref: list[dict] | None, resamples: int, seed: int = 0) -> dict:
    """Summary of one run from its per-prompt ``records`` (``{id, tokens, nfe, answer_acc, exact_match,
    token_f1}``): TPF, and per metric ``{mean, ci, diff, diff_ci}`` (diff against ``ref``'s records for the same
    prompts, paired; None without ``ref``).

    Raises:
        ValueError: ``ref`` lacks a prompt of ``records``.
    """
    tokens, nfe = sum(r["tokens"] for r in records), sum(r["nfe"] for r in records)
    out = {"n": len(records), "tokens_mean": tokens / len(records), "tpf": tokens / nfe if nfe else None}
    ref_by = {r["id"]: r for r in ref} if ref is not None else None
    if ref_by is not None and any(r["id"] not in ref_by for r in records):
        raise ValueError("paired bootstrap: the reference run lacks some prompts")
    for m in METRICS:
        x = [float(r[m]) for r in records]
        entry = {"mean": sum(x) / len(x), "ci": list(bootstrap_ci(x, resamples=resamples, seed=seed)),
                 "diff": None, "diff_ci": None}
        if ref_by is not None:
            y = [float(ref_by[r["id"]][m]) for r in records]
            entry["diff"] = entry["mean"] - sum(y) / len(y)
            entry["diff_ci"] = list(bootstrap_ci(x, y, resamples=resamples, seed=seed))
        out[m] = entry
    return out


def tpf_target(runs: list[dict], base: str, reference: str = REFERENCE, metric: str = "answer_acc",
               ratio_min: float = TPF_RATIO_MIN) -> dict:
    """Issue 26's first target ("the TPF at which a model's accuracy is still inside the base's one-token-per-step
    interval"). ``runs``: ``{model, setting, tpf, <metric>: {mean, ci}}``. The base's interval is its ``reference``
    run's ``ci`` = [lo, hi]; per model ``tpf_at_base_quality`` = the largest TPF of its runs whose point estimate
    ``mean`` is >= lo (inside the interval or above it: better than the base is not a failure; the run's own
    interval is not used, so a noisy run whose interval merely overlaps does not count) (None when none is);
    ``ratio`` = that / the base's own; ``pass`` = ratio >= ratio_min.

    Returns:
        ``{metric, base, reference, base_interval, base_tpf_at_base_quality, models: {name: {tpf_at_base_quality,
        setting, ratio, pass}}}``; empty ``models`` when the base's reference run is missing.

    Raises:
        ValueError: a run of the base model at the reference setting is missing.
    """
    ref = [r for r in runs if r["model"] == base and r["setting"] == reference]
    if not ref:
        raise ValueError(f"tpf target: no run of the base model {base!r} at {reference}")
    lo, hi = ref[0][metric]["ci"]

    def best(model: str):
        ok = [r for r in runs if r["model"] == model and r.get("tpf") is not None
              and r[metric]["mean"] >= lo]
        return max(ok, key=lambda r: r["tpf"]) if ok else None

    b = best(base)
    base_tpf = b["tpf"] if b else None
    models = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        if model == base:
            continue
        r = best(model)
        ratio = r["tpf"] / base_tpf if r and base_tpf else None
        models[model] = {"tpf_at_base_quality": r["tpf"] if r else None, "setting": r["setting"] if r else None,
                         "ratio": ratio, "pass": ratio is not None and ratio >= ratio_min}
    return {"metric": metric, "base": base, "reference": reference, "base_interval": [lo, hi],
            "ratio_min": ratio_min, "base_tpf_at_base_quality": base_tpf,
            "base_setting": b["setting"] if b else None, "models": models}


# ---------------------------------------------------------------------------------------------------- decoding
def checkable_prompts(data_dir: Path, limit: int = 0) -> list[dict]:
    """The held-out prompts with a checkable ``answer`` (152 in the committed set), in file order."""
    rows, _, _ = ev.load_eval_sets(Path(data_dir))
    rows = [r for r in rows if "answer" in r]
    return rows[:limit] if limit else rows


def score(rows: list[dict], outputs: list[dict], parent_text: dict[str, str]) -> list[dict]:
    """Per-prompt records: ``outputs[i]`` = ``{text, tokens, nfe}`` for ``rows[i]``."""
    out = []
    for row, o in zip(rows, outputs):
        out.append({"id": row["id"], "tokens": o["tokens"], "nfe": o["nfe"], "text": o["text"],
                    "answer_acc": qm.answer_match(o["text"], row["answer"]),
                    "exact_match": qm.exact_match(o["text"], row["answer"]),
                    "token_f1": qm.token_f1(o["text"], parent_text[row["id"]])})
    return out


def _key(model: str, path: str, setting: str, max_tokens: int, ids: list[str]) -> str:
    h = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
    return json.dumps([model, str(Path(path).expanduser().resolve()), setting, max_tokens, h])


def resolve_model(name: str, path: str) -> str:
    """A checkpoint directory, or a training run's ``--out`` (its ``latest`` file names the checkpoint), as the
    checkpoint's path; full checkpoints and adapter-only ones (``--trainable mask_lora``) are accepted.

    Raises:
        EvalError: not a checkpoint (names ``--model NAME=PATH``).
    """
    from unmask.engine.adapter_files import is_adapter_dir
    from unmask.training.realmodel import is_checkpoint

    p = Path(path).expanduser()
    if (p / "latest").is_file():
        p = p / (p / "latest").read_text().strip()
    if not (is_checkpoint(p) or is_adapter_dir(p)):
        raise ev.EvalError(f"--model {name}={path}: not a diffusion checkpoint directory (nor a training run's "
                           "--out with a `latest` file)")
    return str(p)


class MethodsEval:
    """One evaluation (module docstring); ``log`` receives progress lines."""

    def __init__(self, a: argparse.Namespace, log=print):
        self.a, self.log = a, log
        self.out = Path(a.out).expanduser()
        self.rows = checkable_prompts(Path(a.data), a.limit)
        self.ids = [r["id"] for r in self.rows]
        self.models = [ev.parse_model_spec(m) for m in a.model]
        names = [n for n, _ in self.models]
        if not self.models or len(set(names)) != len(names):
            raise ev.EvalError(f"--model: give one or more distinct NAME=PATH (got {names})")
        self.base = a.base or names[0]
        if self.base not in names:
            raise ev.EvalError(f"--base: {self.base!r} is not among the --model names {names}")
        self.settings = [ev.parse_setting(s) for s in a.settings]
        if a.reference not in [s.name for s in self.settings]:
            raise ev.EvalError(f"--reference: {a.reference} is not among --settings")
        self.models = [(n, resolve_model(n, p)) for n, p in self.models]
        a.parent = resolve_model("parent", a.parent)
        self.done: dict[str, list[dict]] = {}
        self.samples = self.out / "eval_methods_samples.jsonl"
        if self.samples.is_file():
            for line in self.samples.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.done[rec["key"]] = rec["records"]
        self.t0 = time.time()
        self.timing: dict[str, float] = {}

    def _decode(self, llm, name: str, path: str, st, parent_text: dict[str, str] | None) -> list[dict]:
        key = _key(name, path, st.name, self.a.max_tokens, self.ids)
        if key in self.done:
            return self.done[key]
        prompts = [llm.apply_chat_template(ev.chat_messages(r)) for r in self.rows]
        t0 = time.time()
        res = llm.generate(prompts, st.params(self.a.max_tokens))
        self.timing[f"{name} {st.name}"] = round(time.time() - t0, 1)
        outs = [{"text": ro.outputs[0].text, "tokens": len(ro.outputs[0].token_ids), "nfe": ro.outputs[0].nfe}
                for ro in res]
        texts = parent_text or {r["id"]: o["text"] for r, o in zip(self.rows, outs)}
        recs = score(self.rows, outs, texts)
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.samples, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"key": key, "records": recs}, ensure_ascii=False) + "\n")
        self.done[key] = recs
        self.log(f"[{name}] {st.name}: {time.time() - t0:.0f}s, acc {sum(r['answer_acc'] for r in recs) / len(recs):.3f}"
                 f", TPF {sum(r['tokens'] for r in recs) / max(1, sum(r['nfe'] for r in recs)):.2f}")
        return recs

    def _llm(self, path: str):
        from unmask.engine.llm import LLM

        return LLM(str(Path(path).expanduser()), max_batch_size=self.a.batch_size, weights=self.a.weights)

    def run(self) -> dict:
        a = self.a
        ref_setting = ev.parse_setting(f"b1-s{a.max_tokens}")   # one token per step: exactly the parent
        key = _key("parent", a.parent, ref_setting.name, a.max_tokens, self.ids)
        llm = None if key in self.done else self._llm(a.parent)
        parent = self._decode(llm, "parent", a.parent, ref_setting, None)
        del llm
        parent_text = {r["id"]: r["text"] for r in parent}
        raw: dict[tuple[str, str], list[dict]] = {("parent", ref_setting.name): parent}
        for name, path in self.models:
            llm = None
            for st in self.settings:
                if _key(name, path, st.name, a.max_tokens, self.ids) not in self.done and llm is None:
                    self.log(f"[{name}] loading {path}")
                    llm = self._llm(path)
                raw[(name, st.name)] = self._decode(llm, name, path, st, parent_text)
            del llm
        result = self.summarise(raw)
        self.write(result)
        return result

    def summarise(self, raw: dict) -> dict:
        a = self.a
        ref = raw[(self.base, a.reference)]
        runs = []
        for (model, setting), recs in raw.items():
            s = run_stats(recs, ref, a.resamples)
            runs.append({"model": model, "setting": setting, **s})
        targets = {"tpf": tpf_target([r for r in runs if r["model"] != "parent"], self.base, a.reference),
                   "tpf_f1": tpf_target([r for r in runs if r["model"] != "parent"], self.base, a.reference,
                                        metric="token_f1")}
        if a.training_runs:
            try:
                tr = json.loads(Path(a.training_runs).expanduser().read_text())
            except (OSError, ValueError) as exc:
                raise ev.EvalError(f"--training-runs {a.training_runs}: {exc}") from exc
            targets["alignment_minutes"] = {m: mr.alignment_target(tr.get("arms", {}), m)
                                            for m in ("eval_loss", "eval_acc")}
        import torch

        meta = {"command": a.command_line, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "elapsed_s": round(time.time() - self.t0, 1), "prompts": len(self.ids),
                "max_tokens": a.max_tokens, "batch_size": a.batch_size, "settings": [s.name for s in self.settings],
                "models": dict(self.models), "parent": a.parent, "base": self.base, "reference": a.reference,
                "resamples": a.resamples, "torch_threads": torch.get_num_threads(),
                "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
                "decode_seconds": self.timing,
                "notes": "answer_acc = extracted-answer accuracy (quality_metrics.answer_match), exact_match = "
                         "strict; token_f1 against the parent's greedy answer (the parent = --parent at b1-s64); "
                         "ci = 95% percentile bootstrap over prompts; diff/diff_ci = paired difference against "
                         "the base at the reference setting; TPF = tokens / forwards over the run; greedy."}
        return {"meta": meta, "runs": runs, "targets": targets}

    def write(self, result: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        ev._atomic_write(self.out / "eval_methods.json", json.dumps(result, indent=1) + "\n")
        ev._atomic_write(self.out / "eval_methods.md", markdown(result))
        plot(result, self.out / "eval_methods.png")
        self.log(f"wrote {self.out / 'eval_methods.json'}, .md, .png ({time.time() - self.t0:.0f}s)")


# ---------------------------------------------------------------------------------------------------- output
def _ci(e: dict, key: str = "ci", nd: int = 3) -> str:
    lo, hi = e[key] if e.get(key) else (None, None)
    return "-" if lo is None else f"[{lo:.{nd}f}, {hi:.{nd}f}]"


def markdown(result: dict) -> str:
    m = result["meta"]
    f = ev._f
    out = ["# Accuracy and F1 against TPF on the checkable held-out set (issue 26)", "",
           f"Command: `{m['command']}`  ",
           f"Date (UTC): {m['date_utc']}; {m['prompts']} prompts, <= {m['max_tokens']} new tokens, batch "
           f"{m['batch_size']}, torch threads {m['torch_threads']}, load average {m['load_average_1_5_15']}; "
           f"base = {m['base']} at {m['reference']}; {m['resamples']} bootstrap resamples.  ",
           f"Notes: {m['notes']}", "",
           "| model | setting | TPF | answer acc | 95% CI | diff vs base b1 | 95% CI | EM | F1 vs parent | 95% CI | "
           "F1 diff | 95% CI |", "|" + "---|" * 12]
    for r in sorted(result["runs"], key=lambda r: (r["model"] != "parent", r["model"], r.get("tpf") or 0)):
        acc, em, f1 = r["answer_acc"], r["exact_match"], r["token_f1"]
        out.append(f"| {r['model']} | {r['setting']} | {f(r['tpf'], 2)} | {f(acc['mean'])} | {_ci(acc)} | "
                   f"{f(acc['diff'])} | {_ci(acc, 'diff_ci')} | {f(em['mean'])} | {f(f1['mean'])} | {_ci(f1)} | "
                   f"{f(f1['diff'])} | {_ci(f1, 'diff_ci')} |")
    t = result["targets"]
    for name, label in (("tpf", "answer accuracy"), ("tpf_f1", "token F1")):
        tt = t[name]
        out += ["", f"Target 1 ({label}): the largest TPF whose point estimate is inside (or above) the base's "
                f"{tt['reference']} 95% interval {_ci({'ci': tt['base_interval']})}, as a ratio to the base's "
                f"({f(tt['base_tpf_at_base_quality'], 2)} at {tt['base_setting']}); pass at >= {tt['ratio_min']}:", ""]
        for model, v in tt["models"].items():
            out.append(f"- {model}: TPF {f(v['tpf_at_base_quality'], 2)} at {v['setting']}, ratio "
                       f"{f(v['ratio'], 2)}: {'PASS' if v['pass'] else 'fail'}")
    if "alignment_minutes" in t:
        out += ["", "Target 2: with alignment, the base's final held-out quality in <= 0.5 x the base's training "
                "minutes to it (training curves; first evaluated point at least as good, for both arms):", ""]
        for metric, v in t["alignment_minutes"].items():
            verdict = "n/a" if v["pass"] is None else ("PASS" if v["pass"] else "fail")
            out.append(f"{mr.alignment_target_line(metric, v)}: {verdict}")
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    """PNG: answer accuracy (left) and token F1 (right) against TPF, one line per model over its settings sorted by
    TPF with its 95% band; the base's reference interval as a grey band; the parent as a star."""
    runs = result["runs"]
    base, refset = result["meta"]["base"], result["meta"]["reference"]
    fig, axes = bc.two_panels((12, 4.6))
    for ax, key, label in ((axes[0], "answer_acc", "answer accuracy (152 checkable prompts)"),
                           (axes[1], "token_f1", "token F1 vs parent")):
        ref = [r for r in runs if r["model"] == base and r["setting"] == refset]
        if ref:
            ax.axhspan(*ref[0][key]["ci"], color="grey", alpha=0.2, label=f"{base} {refset} 95% CI")
        for model in dict.fromkeys(r["model"] for r in runs):
            pts = sorted((r["tpf"], r[key]["mean"], *r[key]["ci"]) for r in runs
                         if r["model"] == model and r.get("tpf") is not None)
            xs = [p[0] for p in pts]
            if model == "parent":
                ax.scatter(xs, [p[1] for p in pts], marker="*", s=150, color="black", label="parent", zorder=3)
                continue
            line, = ax.plot(xs, [p[1] for p in pts], marker="o", ms=3, label=model)
            ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], color=line.get_color(), alpha=0.12)
        ax.set_ylabel(label)
    bc.write_panels(fig, axes, path, "TPF (generated tokens per forward)",
                    "Quality against parallelism, 95% bootstrap bands", legend_fontsize=7)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH", help="a checkpoint (repeatable)")
    p.add_argument("--base", default=None, help="the reference model (default: the first --model)")
    p.add_argument("--reference", default=REFERENCE, help=f"the reference setting (default {REFERENCE})")
    p.add_argument("--parent", default="~/.cache/unmask/models/smollm2-135m-a2d",
                   help="the checkpoint whose b1-s64 answers are the F1 references (the untrained conversion = "
                        "the AR parent)")
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, metavar="SETTING")
    p.add_argument("--training-runs", default=None, metavar="JSON",
                   help="benchmarks/methods_runs.py's runs.json, for the alignment-minutes target")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--data", default=str(ev.DATA))
    p.add_argument("--limit", type=int, default=0, help="only the first N checkable prompts (0 = all 152)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="engine batch")
    p.add_argument("--resamples", type=int, default=10000)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--weights", default="auto", choices=["auto", "native", "fp16", "int8", "int4"])
    return p


def main(argv: list[str] | None = None, log=print) -> int:
    a = add_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args(argv)
    a.command_line = " ".join(["python benchmarks/eval_methods.py"] + (sys.argv[1:] if argv is None else argv))
    try:
        for name in ("max_tokens", "batch_size", "resamples"):
            if getattr(a, name) < 1:
                raise ev.EvalError(f"--{name.replace('_', '-')}: must be >= 1")
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        MethodsEval(a, log).run()
    except ev.EvalError as exc:
        return bc.script_error("eval_methods", exc)
    return 0


if __name__ == "__main__":
    bc.run_script(main)
