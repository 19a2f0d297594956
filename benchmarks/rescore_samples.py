"""Recompute the text-derived quality measures of an earlier ``unmask eval`` run from its samples file.

``eval_quality_samples.jsonl`` keeps every output's text, length, finish reason and reference answer, so the
measures that need nothing else - answer accuracy (exact match, final number, containment), token F1 against the
parent's answer, EOS rate, median length and the share of outputs of <= 4 tokens - can be recomputed with the
current ``quality_metrics`` rules (for example after a fix to answer matching) without decoding again. Measures
that need token ids or the parent model (generative perplexity, rep-3, distinct-2, TPF, speed) stay in the run's
own JSON. No torch import; runs in a second.

    python benchmarks/rescore_samples.py benchmarks/results/eval/recipe/eval_quality_samples.jsonl

Prints a Markdown table; ``--json PATH`` also writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import quality_metrics as qm

from unmask.training.jsonl import json_lines  # standard library only


def load_samples(path: Path) -> list[dict]:
    """The JSON lines of ``path``.

    Raises:
        ValueError: a line that is not a JSON object with ``model``, ``setting``, ``subset``, ``id``, ``text`` and
            ``n_tokens`` (message names ``file:line``).
    """
    rows = []
    for n, row in json_lines(path):
        if not isinstance(row, dict) or not {"model", "setting", "subset", "id", "text", "n_tokens"} <= set(row):
            raise ValueError(f"{path}:{n}: not an eval_quality sample line")
        rows.append(row)
    return rows


def rescore(rows: list[dict]) -> list[dict]:
    """One summary per (model, setting, subset), in first-seen order; F1 is against the ``parent`` rows."""
    parent = {(r["subset"], r["id"]): r["text"] for r in rows if r["model"] == "parent"}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["setting"], r["subset"]), []).append(r)

    def mean(v):
        return sum(v) / len(v) if v else None

    out = []
    for (model, setting, subset), rs in groups.items():
        check = [r for r in rs if r.get("answer")]
        f1 = [qm.token_f1(r["text"], parent[(subset, r["id"])]) for r in rs if (subset, r["id"]) in parent]
        lengths = [int(r["n_tokens"]) for r in rs]
        out.append({
            "model": model, "setting": setting, "subset": subset, "n": len(rs), "n_checkable": len(check),
            "answer_acc": mean([qm.answer_match(r["text"], r["answer"]) for r in check]),
            "exact_match": mean([qm.exact_match(r["text"], r["answer"]) for r in check]),
            "contains_match": mean([qm.contains_answer(r["text"], r["answer"]) for r in check]),
            "token_f1_vs_parent": mean(f1),
            "eos_rate": mean([r.get("finish_reason") == "stop" for r in rs]),
            "tokens_median": statistics.median(lengths) if lengths else None,
            "short_rate": qm.short_output_rate(lengths, 4),
        })
    return out


def markdown(rows: list[dict], source: str) -> str:
    """The rows as a Markdown table (with the source file named)."""
    cols = [("model", "model"), ("set", "subset"), ("setting", "setting"), ("n", "n"), ("answer acc", "answer_acc"),
            ("EM", "exact_match"), ("contains", "contains_match"), ("F1 vs parent", "token_f1_vs_parent"),
            ("EOS rate", "eos_rate"), ("median tokens", "tokens_median"), ("<= 4 tokens", "short_rate")]

    def fmt(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = [f"Rescored from `{source}` with the current `quality_metrics` rules.", "",
             "| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[k]) for _, k in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("samples", help="eval_quality_samples.jsonl of an unmask eval run")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    path = Path(args.samples)
    try:
        rows = rescore(load_samples(path))
    except (OSError, ValueError) as exc:
        print(f"rescore_samples: error: {exc}", file=sys.stderr)
        return 2
    print(markdown(rows, str(path)), end="")
    if args.json:
        Path(args.json).write_text(json.dumps({"source": str(path), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
