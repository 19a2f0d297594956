"""Deterministic generator of the project's prompt sets (no network, no model): a training set of instructions for
teacher self-distillation and a template-disjoint held-out evaluation set, part of it with checkable answers.

Run ``python -m unmask.training.recipes.prompts`` (or ``--out DIR``) to (re)write

* ``benchmarks/data/train_prompts.jsonl`` -- >= 2,000 instructions, one JSON object a line:
  ``{"id", "template", "category", "prompt"}``;
* ``benchmarks/data/eval_prompts.jsonl`` -- >= 200 held-out prompts ``{"id", "template", "category", "prompt",
  "answer"?, "meta"?}``; ``answer`` (a string) is present on checkable items and is compared by exact match after
  normalisation (``benchmarks/quality_metrics.normalize_answer``);
  ``meta`` carries the operands of arithmetic/conversion items so that tests can recompute the answer;
* ``benchmarks/data/eval_grid_ids.json`` -- the fixed 60-prompt subset used for the parallelism grid
  (``{"ids": [...], "quick_ids": [...]}``; ``quick_ids`` are its first 12, used by ``--quick``).

The templates, their slot values and the hand-written prompts are data: ``prompt_templates.json`` beside this module
(package data), read by :func:`load_table`; this module draws from it.

Rules (issue 5, docs/design.md#decisions "Evaluation"):

* every item records the id of the template that produced it; training templates are named ``train.*`` and
  evaluation templates ``eval.*``, and no template produces items for both sets (hand-written items have their own
  per-set template ids ``train.hand.<category>`` / ``eval.hand.<category>``); the texts are also checked for overlap;
* the checkable set is built before and independently of any model: nothing is filtered by the parent's success;
* all randomness comes from ``random.Random(crc32(template id) ^ SEED)``, so the output is byte-identical on every
  run and every machine (Python's ``hash`` is salted and is never used).
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import operator
import random
import zlib
from pathlib import Path

from ..jsonl import json_lines, write_jsonl

SEED = 20261130
REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "benchmarks" / "data"
TRAIN_FILE = "train_prompts.jsonl"
EVAL_FILE = "eval_prompts.jsonl"
GRID_FILE = "eval_grid_ids.json"
EXTRA_FILE = "train_extra_prompts.jsonl"
GRID_SIZE = 60
QUICK_SIZE = 12

TEMPLATES_FILE = Path(__file__).with_name("prompt_templates.json")


# ----------------------------------------------------------------------------------------------------- the table
@functools.lru_cache(maxsize=1)
def load_table(path: str | Path = TEMPLATES_FILE) -> dict:
    """The template table (``prompt_templates.json``, packaged data): ``lists`` (slot values by name), ``train`` /
    ``eval`` templates, ``train_hand`` / ``eval_hand_checkable`` / ``eval_hand_open`` hand-written prompts.

    A template is ``{"id", "category", "count", "slots", "let"?, "text", "answer"?, "op"?, "meta"?}``: ``count`` an
    integer or a list's name (its length); ``slots`` drawn in order from the template's generator (a list's name or
    a literal list: ``choice``; ``{"int": [lo, hi]}``: ``randint``; ``{"range": [start, stop, step]}``: ``choice``
    over it; ``{"sample": values, "k": k}``; ``{"below": n}``: ``randrange``); ``let`` values computed from them
    (:func:`_value`); ``text`` a ``str.format`` template, or a list of them drawn after the slots; ``answer`` and
    ``meta`` (with ``op``) expressions of checkable items.
    """
    return json.loads(Path(path).read_text(encoding="utf-8"))


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}
_FUNCS = {"max": max, "min": min, "argmin": lambda xs: xs.index(min(xs)), "word_count": lambda s: len(s.split())}


def _value(expr, env: dict):
    """A template expression: a number, or names, integers, ``+ - * // %``, indexing and :data:`_FUNCS` calls."""
    if not isinstance(expr, str):
        return expr

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Subscript):
            return ev(node.value)[ev(node.slice)]
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in _FUNCS:
            return _FUNCS[node.func.id](*map(ev, node.args))
        raise ValueError(f"prompt templates: {expr!r}: {type(node).__name__} is not a template expression")
    return ev(ast.parse(expr, mode="eval").body)


def _draw(spec, rng: random.Random, env: dict):
    if isinstance(spec, str):
        return rng.choice(list(env[spec]))
    if isinstance(spec, list):
        return rng.choice(spec)
    if "int" in spec:
        return rng.randint(*(_value(x, env) for x in spec["int"]))
    if "below" in spec:
        return rng.randrange(spec["below"])
    if "range" in spec:
        return rng.choice(range(*spec["range"]))
    pool = spec["sample"]
    pool = env[pool] if isinstance(pool, str) else range(*pool["range"]) if isinstance(pool, dict) else pool
    return rng.sample(pool, spec["k"])


def _maker(t: dict, lists: dict):
    """``make(rng) -> (prompt, extra)`` of one template (see :func:`load_table`)."""
    def make(rng: random.Random):
        env = dict(lists)
        for name, spec in t["slots"].items():
            env[name] = _draw(spec, rng, env)
        for name, expr in t.get("let", {}).items():
            env[name] = _value(expr, env)
        text = t["text"] if isinstance(t["text"], str) else rng.choice(t["text"])
        extra = {}
        if "answer" in t:
            extra["answer"] = str(_value(t["answer"], env))
        if "op" in t:
            extra["meta"] = {"op": t["op"], **{k: _value(v, env) for k, v in t["meta"].items()}}
        return text.format(**env), extra
    return make


def _rng(template: str) -> random.Random:
    return random.Random(zlib.crc32(template.encode()) ^ SEED)


def _fill(template: str, count: int, make) -> list[dict]:
    """Draw up to ``count`` distinct items from ``make(rng) -> (prompt, extra dict)``; duplicates are redrawn."""
    rng = _rng(template)
    seen: set[str] = set()
    out: list[dict] = []
    tries = 0
    while len(out) < count and tries < count * 50:
        tries += 1
        prompt, extra = make(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"template": template, "prompt": prompt, **extra})
    return out


def _templated(kind: str) -> list[tuple[str, str, int, object]]:
    """(template id, category, count, maker) of the ``train`` or ``eval`` set, in the table's order."""
    table = load_table()
    lists = table["lists"]
    return [(f"{kind}.{t['id']}", t["category"], len(lists[t["count"]]) if isinstance(t["count"], str) else t["count"],
             _maker(t, lists)) for t in table[kind]]


# ----------------------------------------------------------------------------------------------------- builders
def build_train() -> list[dict]:
    """The training prompts, in a fixed order, ids ``train-00000`` ... Duplicated prompt texts are dropped."""
    items: list[dict] = []
    for tid, cat, n, make in _templated("train"):
        for it in _fill(tid, n, make):
            items.append({"template": tid, "category": cat, "prompt": it["prompt"]})
    for cat, prompts in load_table()["train_hand"].items():
        items.extend({"template": f"train.hand.{cat}", "category": cat, "prompt": p} for p in prompts)
    return _number(_dedupe(items), "train")


def build_train_extra(factor: int = 4, seed: int = 1) -> list[dict]:
    """More training prompts from the same ``train.*`` templates: up to ``factor`` times each template's count,
    drawn with another seed, dropping every text already in the training or held-out set (so the evaluation stays
    template- and text-disjoint). Ids ``trainx-00000`` ...; hand-written prompts are not repeated. For data-hungry
    stages; ``factor=4`` gives 3,475 prompts (single-slot
    templates run out of new texts), ``factor=1`` 1,556.

    Raises:
        ValueError: ``factor`` < 1.
    """
    if factor < 1:
        raise ValueError("factor: must be >= 1")
    taken = {it["prompt"] for it in build_train()} | {it["prompt"] for it in build_eval()}
    items: list[dict] = []
    for tid, cat, n, make in _templated("train"):
        rng = random.Random(zlib.crc32(tid.encode()) ^ SEED ^ (seed * 0x9E3779B1))
        got: set[str] = set()
        for _ in range(n * factor * 20):
            if len(got) >= n * factor:
                break
            prompt, _extra = make(rng)
            if prompt in taken or prompt in got:
                continue
            got.add(prompt)
            items.append({"template": tid, "category": cat, "prompt": prompt})
    return _number(items, "trainx")


def build_eval() -> list[dict]:
    """The held-out prompts, ids ``eval-0000`` ...; checkable items carry ``answer`` (and ``meta``)."""
    items: list[dict] = []
    for tid, cat, n, make in _templated("eval"):
        for it in _fill(tid, n, make):
            row = {"template": tid, "category": cat, "prompt": it["prompt"]}
            if "answer" in it:
                row["answer"] = it["answer"]
            if "meta" in it:
                row["meta"] = it["meta"]
            items.append(row)
    for p, a in load_table()["eval_hand_checkable"]:
        items.append({"template": "eval.hand.checkable", "category": "everyday", "prompt": p, "answer": a})
    for cat, prompts in load_table()["eval_hand_open"].items():
        items.extend({"template": f"eval.hand.{cat}", "category": cat, "prompt": p} for p in prompts)
    return _number(_dedupe(items), "eval")


def _dedupe(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for it in items:
        if it["prompt"] not in seen:
            seen.add(it["prompt"])
            out.append(it)
    return out


def _number(items: list[dict], prefix: str) -> list[dict]:
    width = 4 if prefix == "eval" else 5
    return [{"id": f"{prefix}-{i:0{width}d}", **it} for i, it in enumerate(items)]


def grid_subset(eval_items: list[dict], size: int = GRID_SIZE, checkable_share: float = 0.6) -> list[str]:
    """Fixed grid subset: ``round(size * checkable_share)`` checkable and the rest open prompts, drawn round-robin
    over templates (so every template is represented before any repeats) in a seeded order. The first
    ``QUICK_SIZE`` ids interleave checkable and open items, so ``--quick`` sees both kinds."""
    rng = random.Random(SEED)
    n_check = round(size * checkable_share)

    def round_robin(rows: list[dict], n: int) -> list[str]:
        by_t: dict[str, list[str]] = {}
        for r in rows:
            by_t.setdefault(r["template"], []).append(r["id"])
        templates = sorted(by_t)
        rng.shuffle(templates)
        for t in templates:
            rng.shuffle(by_t[t])
        out: list[str] = []
        while len(out) < n and any(by_t.values()):
            for t in templates:
                if by_t[t] and len(out) < n:
                    out.append(by_t[t].pop())
        return out

    check = round_robin([r for r in eval_items if "answer" in r], n_check)
    opn = round_robin([r for r in eval_items if "answer" not in r], size - n_check)
    ids: list[str] = []
    ci, oi = iter(check), iter(opn)
    pattern = [ci, ci, oi] * size  # 2 checkable : 1 open, then whatever is left
    for src in pattern:
        nxt = next(src, None)
        if nxt is not None:
            ids.append(nxt)
    ids.extend(x for x in list(ci) + list(oi))
    return ids


def write_all(out_dir: str | Path = DATA_DIR) -> dict[str, Path]:
    """Write the three files into ``out_dir`` (created if missing). Returns their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, evals = build_train(), build_eval()
    ids = grid_subset(evals)
    write_jsonl(out / TRAIN_FILE, train)
    write_jsonl(out / EVAL_FILE, evals)
    grid = out / GRID_FILE
    grid.write_text(json.dumps({"ids": ids, "quick_ids": ids[:QUICK_SIZE]}, indent=1) + "\n", encoding="utf-8")
    return {"train": out / TRAIN_FILE, "eval": out / EVAL_FILE, "grid": grid}


def load_prompts(path: str | Path) -> list[dict]:
    """Read a prompt JSONL file (``{"id", "prompt", ...}`` per line).

    Raises:
        ValueError: ``file:line: reason`` for a line that is not a JSON object with a non-empty string ``prompt``
            and a string ``id``, or a duplicated id.
    """
    rows, seen = [], set()
    for n, row in json_lines(path):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{path}:{n}: expected an object with a non-empty string 'prompt'")
        if not isinstance(row.get("id"), str):
            raise ValueError(f"{path}:{n}: expected a string 'id'")
        if row["id"] in seen:
            raise ValueError(f"{path}:{n}: duplicated id {row['id']!r}")
        seen.add(row["id"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI: write the train/eval prompt files and the grid ids to ``--out`` (default ``benchmarks/data``); returns 0."""
    ap = argparse.ArgumentParser(description="Write the train/eval prompt sets (deterministic, no network).")
    ap.add_argument("--out", default=str(DATA_DIR), help="output directory (default benchmarks/data)")
    ap.add_argument("--extra-train", type=int, default=0, metavar="FACTOR",
                    help=f"also write {EXTRA_FILE}: up to FACTOR x each training template's count of new prompts "
                         f"from the same templates (build_train_extra)")
    args = ap.parse_args(argv)
    if args.extra_train < 0:
        ap.error("--extra-train: must be >= 0")
    paths = write_all(args.out)
    if args.extra_train:
        paths["train_extra"] = Path(args.out) / EXTRA_FILE
        write_jsonl(paths["train_extra"], build_train_extra(args.extra_train))
    for name, p in paths.items():
        print(f"{name}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
