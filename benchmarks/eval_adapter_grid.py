"""The 60-prompt grid of ``eval_quality.py`` for one engine model, without the transformers parent: the reference
is the model's own ``b1-s64`` decoding through the engine (for a mask-row adapter: its parent, exactly;
docs/design.md#mask-row-adapter), so the run needs no float32 transformers copy and no perplexity pass (a loaded machine
could not afford them).

Same prompts (``benchmarks/data/eval_grid_ids.json``, chat template), same settings grammar (``eval_quality.parse_setting``),
same greedy decoding, max tokens and scoring (``eval_quality.summarise``: answer accuracy, exact match, contains,
token F1 and '= parent' against the reference, TPF = generated tokens / forwards, rep-3, distinct-2) as
``eval_quality.py``; the first setting must be the reference (``b1-s<max tokens>``). Differences: F1 and '= parent' are
against the parent through the engine (fp16-packed; it differs from transformers' float32 greedy at rare near-ties:
F1 0.980 on this grid, docs/results.md), and there is no generative perplexity. Writes
``<out>/eval_grid.{json,md}`` and ``eval_grid_samples.jsonl`` (every output; not tracked) after every setting
(``"finished": false`` until the last).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/eval_adapter_grid.py --model ~/.cache/unmask/models/smollm2-135m-a2d-mask-adapter \\
        --settings b1-s64 b4-spec b4-spec-br0 b4-t0.3 b4-t0.5 b4-t0.7 b4-t0.9 --out benchmarks/results/eval/default-adapter
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import eval_quality as ev  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="engine checkpoint or adapter directory")
    ap.add_argument("--settings", nargs="+", required=True, metavar="SETTING", help="the first is the reference")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="auto", help="the engine's --weights (default auto, as `unmask serve`)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference-samples", default=None, metavar="JSONL",
                    help="another run's eval_grid_samples.jsonl: its first setting's outputs are the reference "
                         "(same model, max tokens), so --settings need not start with it")
    args = ap.parse_args(argv)
    settings = [ev.parse_setting(s) for s in args.settings]
    reference = read_reference(args.reference_samples) if args.reference_samples else {}
    if not reference and (settings[0].block_size != 1 or settings[0].speculative or settings[0].temperature):
        ap.error(f"--settings: the first must be the greedy block-1 reference (b1-s{args.max_tokens}), "
                 f"got {settings[0].name}")
    bc.set_threads(args.threads)
    from unmask.engine.llm import LLM

    rows, grid_ids, _ = ev.load_eval_sets()
    rows_by_id = {r["id"]: r for r in rows}
    env = bc.environment(args.threads)
    llm = LLM(os.path.expanduser(args.model), max_batch_size=args.batch_size, weights=args.weights)
    prompt_ids = {pid: llm.apply_chat_template(ev.chat_messages(rows_by_id[pid])) for pid in grid_ids}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    meta = {"command": bc.command_line(), "model": args.model, "weight_format": llm.model.weight_format,
            "adapter": llm.model.adapter, "grid_prompts": len(grid_ids), "max_tokens": args.max_tokens,
            "batch_size": args.batch_size, "environment": env,
            "reference": (f"the first setting of {args.reference_samples}" if reference else
                          f"{settings[0].name} of this model through the engine")}
    for st in settings:
        t0 = time.time()
        outs = llm.generate([prompt_ids[i] for i in grid_ids], st.params(args.max_tokens))
        samples = [ev.Sample(pid, list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason,
                             o.outputs[0].steps, o.outputs[0].nfe, prompt_ids[pid]) for pid, o in zip(grid_ids, outs)]
        if not reference:
            reference = {x.prompt_id: x for x in samples}
        run = ev.Run("model", st.name, "grid", samples)
        run.summary = ev.summarise(run, rows_by_id, reference, [])
        run.summary["batched_wall_s"] = round(time.time() - t0, 1)
        run.summary["loadavg_after"] = list(os.getloadavg())
        runs.append(run)
        s = run.summary
        print(f"{st.name}: TPF {s['tpf']:.3f} acc {s['answer_acc']:.3f} F1 {s['token_f1_vs_parent']:.3f} "
              f"= parent {s['same_as_parent']:.2f} ({s['batched_wall_s']} s)", flush=True)
        write(out, meta, runs, finished=st is settings[-1])
    return 0


def read_reference(path: str) -> dict:
    """``{prompt_id: Sample}`` of the first setting in an ``eval_grid_samples.jsonl`` (or an ``eval_grid.json``
    holding ``samples``, as the first version of this script wrote them)."""
    text = Path(path).read_text()
    rows = (json.loads(text)["samples"] if path.endswith(".json") else
            [json.loads(line) for line in text.splitlines() if line.strip()])
    first = rows[0]["setting"]
    return {r["prompt_id"]: ev.Sample(r["prompt_id"], r["token_ids"], r["text"], r["finish_reason"], r["nfe"],
                                      r["nfe"]) for r in rows if r["setting"] == first}


def write(out: Path, meta: dict, runs: list, finished: bool) -> None:
    data = {"meta": {**meta, "finished": finished}, "runs": [{"setting": r.setting, **r.summary} for r in runs]}
    (out / "eval_grid.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "eval_grid_samples.jsonl").write_text("".join(  # every output (not tracked, as eval_quality's samples)
        json.dumps({"setting": r.setting, "prompt_id": x.prompt_id, "token_ids": x.token_ids, "text": x.text,
                    "finish_reason": x.finish_reason, "nfe": x.nfe}) + "\n" for r in runs for x in r.samples))
    cols = [("setting", "setting", None), ("n", "n", None), ("NFE", "nfe_mean", 1), ("TPF", "tpf", 2),
            ("answer acc", "answer_acc", 3), ("EM", "exact_match", 3), ("F1 vs parent (engine)", "token_f1_vs_parent", 3),
            ("= parent", "same_as_parent", 2), ("rep-3", "rep3", 3), ("distinct-2", "distinct2", 3),
            ("EOS rate", "eos_rate", 2), ("median tokens", "tokens_median", 1)]
    env = meta["environment"]
    lines = ["# The 60-prompt grid through the engine (reference: the model's own block-1 decoding)", "",
             f"Command: `{meta['command']}`  ",
             f"Model {meta['model']} ({meta['weight_format']} weights); started {env['utc']}, {env['cpu_count']} CPU "
             f"cores, load average {env['loadavg_start'][0]:.1f} at the start (no timings are reported); "
             f"{meta['grid_prompts']} grid prompts, max {meta['max_tokens']} new tokens, greedy, batch "
             f"{meta['batch_size']} (the engine is batch-invariant). Scoring: `eval_quality.summarise`; F1 and "
             f"'= parent' against {meta['reference']}.{'' if finished else ' (partial: the run has not finished)'}",
             "", "| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        lines.append("| " + " | ".join(ev._f(float(r.summary[k]), nd) if nd is not None and r.summary.get(k) is not None
                                       else ev._f(r.summary.get(k) if k != "setting" else r.setting)
                                       for _, k, nd in cols) + " |")
    (out / "eval_grid.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
