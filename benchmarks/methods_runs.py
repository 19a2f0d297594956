"""Fixed-budget training arms of issue 26 (docs/methods.md "Fixed-budget comparison"; docs/design.md#the-seeds-methods).

Every arm starts from the same checkpoint (``--model``, by default the a2d conversion of SmolLM2-135M-Instruct,
``~/.cache/unmask/models/smollm2-135m-a2d``) and trains on the same examples (``--data`` minus every example whose
prompt is in ``--heldout``; the split is written once into ``WORK/train.jsonl`` / ``WORK/heldout.jsonl``) for the
same budget of ``--minutes`` *training minutes* with the same seed, batch, sequence length, warmup and learning-rate
schedule (a cosine over the budget, ``cosine_time``):

======================  =============================================================================================
arm                     what differs from ``base``
======================  =============================================================================================
``base`` (= ``full``)   the recipe's train stage: block objective, full fine-tuning, lr 1e-4, CE (+ KL 1.0 to the
                        stored teacher top-k when the data carries it; ``--teacher-kl`` overrides)
``align``               ``--align-weight 10 --align-layers all`` (Repr-Align, live teacher = the start checkpoint
                        run causally, i.e. the parent)
``trajectory``          ``--objective trajectory``; the trajectories are recorded first (``--trajectory-mode``, by
                        default ``entropy`` with 8 steps: the untrained conversion's own threshold decoding gives a
                        near left-to-right order, docs/methods.md) in a separate stage whose wall time is reported
                        beside the arm and is NOT part of its training minutes
``freeze_ffn``,         ``--trainable freeze_ffn`` / ``qk_only``
``qk_only``
``lora``, ``mask_lora`` ``--trainable lora`` / ``mask_lora`` at ``--lora-lr`` (default 5e-4: LoRA's few parameters
                        conventionally take a higher learning rate than full fine-tuning; r 16, alpha 32)
======================  =============================================================================================

**Training minutes** are the summed step times of ``metrics.csv`` (``tokens / tokens_per_s`` of each row: data,
forward, backward, optimizer step), so the periodic held-out evaluation (``--eval-every`` steps: the trainer's
``eval_loss`` = block ELBO over a fixed ``t`` grid with fixed noise, comparable across arms and objectives, and
``eval_acc`` = masked-token accuracy), checkpoint writes and model loading do not eat an arm's budget. The trainer
stops on *wall* time (which includes them), so an arm is relaunched with ``--resume`` and the remaining training
minutes until less than ``max(1% of the budget, one median step)`` remain (each relaunch reloads the model; the
learning-rate cosine spans the whole budget through ``minutes_before``). After the budget one more held-out
evaluation of the final weights gives the curve's last point.

Resumable: rerunning the same command continues unfinished arms from their ``latest`` checkpoint (``--save-every``
steps, the trainer's exact resume) and skips finished ones (``WORK/<arm>/done.json``); an arm started with other
settings is an error naming them. Outputs per arm: ``WORK/<arm>/`` (checkpoints, ``metrics.csv``), and in
``--results`` (default ``benchmarks/results/training/methods/budget/``) ``<arm>-metrics.csv`` plus
``runs.json`` / ``runs.md`` / ``runs.png`` (held-out loss and accuracy against training minutes, one line per arm)
and the alignment target (:func:`alignment_target`).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/methods_runs.py --work W/budget \\
        --data W/all.jsonl --heldout W/heldout.jsonl --minutes 8 --eval-every 10 \\
        --arms base,align,trajectory,freeze_ffn,qk_only,lora,mask_lora \\
        --results benchmarks/results/training/methods/budget/
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
from eval_quality import _f  # noqa: E402  (one number formatter for every results table)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "training" / "methods" / "budget"
DEFAULT_MODEL = "~/.cache/unmask/models/smollm2-135m-a2d"
ARMS = ("base", "align", "trajectory", "full", "freeze_ffn", "qk_only", "lora", "mask_lora")
ALIASES = {"full": "base"}   # the base arm IS the full-fine-tuning scope arm (same settings: run once)
MAX_LAUNCHES = 8


class RunsError(ValueError):
    """Bad driver input (an option, a data file, settings that differ from a started arm); the message names it."""


# ---------------------------------------------------------------------------------------------------- data
def _prompt_key(row: dict, where: str) -> str:
    if "prompt" in row:
        return json.dumps(row["prompt"])
    if "messages" in row:
        return json.dumps([m for m in row["messages"] if m.get("role") != "assistant"])
    raise RunsError(f"{where}: a line without `prompt` or `messages`")


def _read_jsonl(path: Path) -> list[dict]:
    from unmask.training.jsonl import json_lines

    try:
        return [row for _, row in json_lines(path, RunsError)]
    except OSError as exc:
        raise RunsError(f"{path}: {exc.strerror or exc}") from None


def split_data(data: Path, heldout: Path, work: Path) -> tuple[Path, Path, dict]:
    """Write ``work/train.jsonl`` (``data`` without the examples whose prompt is in ``heldout``) and
    ``work/heldout.jsonl`` once; returns their paths and counts. A rerun with other files is an error.

    Raises:
        RunsError: unreadable files, an empty training or held-out set, or a split that differs from the one
            already in ``work``.
    """
    rows, held = _read_jsonl(Path(data)), _read_jsonl(Path(heldout))
    keys = {_prompt_key(r, f"{heldout}:{i + 1}") for i, r in enumerate(held)}
    train = [r for i, r in enumerate(rows) if _prompt_key(r, f"{data}:{i + 1}") not in keys]
    if not train or not held:
        raise RunsError(f"--data {data} / --heldout {heldout}: {len(train)} training and {len(held)} held-out "
                        "examples after the split")
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, part in (("train.jsonl", train), ("heldout.jsonl", held)):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        path = work / name
        if path.is_file() and path.read_text(encoding="utf-8") != text:
            raise RunsError(f"{path}: holds another split than --data/--heldout give now; use another --work")
        if not path.is_file():
            path.write_text(text, encoding="utf-8")
        out[name] = path
    info = {"data": str(data), "heldout": str(heldout), "data_rows": len(rows), "train_rows": len(train),
            "heldout_rows": len(held), "removed_from_data": len(rows) - len(train),
            "teacher_top_k": any("teacher" in r for r in train)}
    return out["train.jsonl"], out["heldout.jsonl"], info


# ---------------------------------------------------------------------------------------------------- configs
def arm_config(arm: str, a: argparse.Namespace, train: Path, heldout: Path, has_top_k: bool, minutes: float,
               minutes_before: float):
    """The ``TrainConfig`` of one arm (module docstring) for a launch with ``minutes`` wall minutes left."""
    from unmask.training.trainer import TrainConfig

    work = Path(a.work)
    kl = a.teacher_kl if a.teacher_kl is not None else (1.0 if has_top_k else 0.0)
    kw = dict(model=str(Path(a.model).expanduser()), data=str(train), eval_data=str(heldout),
              out=str(work / arm), objective="block", trainable="full", block_size=a.block_size,
              batch_size=a.batch_size, seq_len=a.seq_len, max_steps=a.max_steps, max_minutes=minutes,
              minutes_before=minutes_before, lr=a.lr, lr_schedule="cosine_time", warmup=a.warmup, seed=a.seed,
              eval_every=a.eval_every, eval_t_points=a.eval_t_points, save_every=a.save_every, keep_last=1,
              teacher_kl=kl, teacher=a.teacher, resume=True, progress=False)
    if arm == "align":
        kw.update(align_weight=a.align_weight, align_layers="all")
    elif arm == "trajectory":
        kw.update(objective="trajectory", trajectories=str(work / "trajectory.jsonl"),
                  trajectory_mode=a.trajectory_mode, trajectory_steps=a.trajectory_steps,
                  trajectory_threshold=a.trajectory_threshold)
    elif arm in ("freeze_ffn", "qk_only"):
        kw.update(trainable=arm)
    elif arm in ("lora", "mask_lora"):
        kw.update(trainable=arm, lr=a.lora_lr)
    elif arm != "base":
        raise RunsError(f"--arms: unknown arm {arm!r} (one of {', '.join(ARMS)})")
    return TrainConfig(**kw)


def _locked(cfg) -> dict:
    """The settings an arm is locked to (everything but the per-launch budget fields)."""
    d = dataclasses.asdict(cfg)
    for k in ("max_minutes", "minutes_before", "resume", "progress", "halt_after"):
        d.pop(k, None)
    return d


# ---------------------------------------------------------------------------------------------------- curves
def read_curve(metrics_csv: Path, upto_step: int | None = None) -> list[dict]:
    """Rows of a trainer ``metrics.csv`` with cumulative training minutes: ``[{step, train_min, loss,
    eval_loss, eval_acc}]`` (eval fields None on steps without an evaluation). A step's time is
    ``tokens / tokens_per_s`` (the trainer's own step timing, evaluation excluded).

    Raises:
        RunsError: a row without step/tokens/tokens_per_s (``file:line``).
    """
    out, total = [], 0.0
    if not Path(metrics_csv).is_file():
        return out
    with open(metrics_csv, newline="") as fh:
        for i, r in enumerate(csv.DictReader(fh), 2):
            try:
                step, tok, tps = int(r["step"]), float(r["tokens"]), float(r["tokens_per_s"])
            except (KeyError, TypeError, ValueError):
                raise RunsError(f"{metrics_csv}:{i}: needs step, tokens and tokens_per_s") from None
            if upto_step is not None and step > upto_step:
                break
            total += tok / tps / 60 if tps > 0 else 0.0
            out.append({"step": step, "train_min": round(total, 4), "loss": float(r["loss"]),
                        "eval_loss": float(r["eval_loss"]) if r.get("eval_loss") else None,
                        "eval_acc": float(r["eval_acc"]) if r.get("eval_acc") else None})
    return out


def minutes_to_reach(curve: list[tuple[float, float]], target: float, lower_is_better: bool) -> float | None:
    """The training minute of the first evaluated point ``(minute, value)`` (in minute order) at least as good as
    ``target`` (``<=`` when lower is better, else ``>=``); None when no point reaches it. No interpolation: the
    answer is a minute at which the quality was measured."""
    for m, v in sorted(curve):
        if (v <= target) if lower_is_better else (v >= target):
            return m
    return None


def alignment_target(arms: dict, metric: str = "eval_loss", ratio_max: float = 0.5,
                     base: str = "base", aligned: str = "align") -> dict:
    """Issue 26's second target: with alignment, the base's final quality in at most ``ratio_max`` of the base's
    training minutes. ``arms[name]`` = ``{"curve": [{train_min, eval_loss, eval_acc}], "train_minutes": M}``
    (:func:`summarise`'s per-arm entries); the base's final quality is its last evaluated point, and the base's
    minutes are those of its *first* evaluated point at that quality (``base_minutes_to_reach``): its whole budget
    when the curve improves to the end (the held-out ELBO here), less when the metric peaked earlier (masked-token
    accuracy, which falls over the first steps of these runs: dividing by the whole budget would credit alignment
    with reaching a quality the base already had at its first point).

    Returns:
        ``{metric, base_final, base_minutes, base_minutes_to_reach, aligned_minutes_to_reach, ratio, pass}``
        (``ratio`` = aligned / base minutes to reach; ``pass`` None when an arm or its curve is missing; ``ratio``
        None and ``pass`` False when the aligned arm never reaches it).
    """
    lower = metric == "eval_loss"
    out = {"metric": metric, "lower_is_better": lower, "ratio_max": ratio_max, "base_final": None,
           "base_minutes": None, "base_minutes_to_reach": None, "aligned_minutes_to_reach": None, "ratio": None,
           "pass": None}
    if base not in arms or aligned not in arms:
        return out
    pts = {k: [(p["train_min"], p[metric]) for p in arms[k]["curve"] if p.get(metric) is not None]
           for k in (base, aligned)}
    if not pts[base] or not pts[aligned]:
        return out
    final = max(pts[base])[1]
    m_base = arms[base]["train_minutes"]
    base_reach = minutes_to_reach(pts[base], final, lower)
    reach = minutes_to_reach(pts[aligned], final, lower)
    out.update(base_final=final, base_minutes=m_base, base_minutes_to_reach=base_reach,
               aligned_minutes_to_reach=reach)
    out["ratio"] = reach / base_reach if reach is not None and base_reach else None
    out["pass"] = out["ratio"] is not None and out["ratio"] <= ratio_max
    return out


# ---------------------------------------------------------------------------------------------------- running
def _final_eval(cfg) -> tuple[float, float]:
    """Held-out (ELBO, masked-token accuracy) of the arm's latest checkpoint, exactly as the trainer evaluates
    during training (same t grid and noise seeds)."""
    from unmask.training.trainer import Trainer

    tr = Trainer(cfg)
    tr._load()
    return tr.evaluate()


def run_arm(arm: str, a: argparse.Namespace, train: Path, heldout: Path, has_top_k: bool, log=print) -> dict:
    """Train one arm to its budget (relaunching with the remaining training minutes), evaluate its final
    weights, write ``WORK/<arm>/done.json`` and return it. A finished arm is read back, not rerun.

    Raises:
        RunsError: the arm was started with other settings; a launch made no progress.
        TrainError: from the trainer.
    """
    from unmask.training.trainer import resolve_latest

    out = Path(a.work) / arm
    cfg0 = arm_config(arm, a, train, heldout, has_top_k, a.minutes, 0.0)
    lock = out / "arm.json"
    if lock.is_file():
        saved = json.loads(lock.read_text())
        diff = {k: (saved.get(k), v) for k, v in _locked(cfg0).items() if saved.get(k) != v}
        if diff:
            raise RunsError(f"arm {arm}: {out} was started with other settings {diff} (saved, now); use another "
                            "--work or the same options")
    done = out / "done.json"
    if done.is_file():
        log(f"[{arm}] finished earlier: {done}")
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps(_locked(cfg0), indent=1) + "\n")
    from unmask.training.trainer import train as run_train

    record_s = None
    if arm == "trajectory":
        rec_file = out / "record.json"
        if rec_file.is_file():
            record_s = json.loads(rec_file.read_text())["seconds"]
        else:   # the recording stage, timed apart from the training minutes (Trainer._load records what is missing)
            from unmask.training.trainer import Trainer

            t0 = time.time()
            Trainer(cfg0)._load()
            record_s = round(time.time() - t0, 1)
            rec_file.write_text(json.dumps({"seconds": record_s, "mode": a.trajectory_mode}) + "\n")
            log(f"[{arm}] recorded trajectories in {record_s:.0f}s (not part of the training minutes)")
            gc.collect()
    t_wall = time.time()
    launches = 0
    while True:
        latest = resolve_latest(out)
        step = int(latest.name.split("-")[-1]) if latest else 0
        curve = read_curve(out / "metrics.csv", step)
        used = curve[-1]["train_min"] if curve else 0.0
        steps_min = [b["train_min"] - p["train_min"] for p, b in zip(curve, curve[1:])]
        tol = max(0.01 * a.minutes, statistics.median(steps_min) if steps_min else 0.0)
        left = a.minutes - used
        if left <= tol or step >= a.max_steps:
            break
        if launches >= MAX_LAUNCHES:
            raise RunsError(f"arm {arm}: {launches} launches and still {left:.2f} training minutes left")
        launches += 1
        log(f"[{arm}] launch {launches}: step {step}, {used:.2f}/{a.minutes:g} training minutes used")
        run_train(arm_config(arm, a, train, heldout, has_top_k, left, used))
        gc.collect()
    latest = resolve_latest(out)
    step = int(latest.name.split("-")[-1])
    el, ea = _final_eval(arm_config(arm, a, train, heldout, has_top_k, a.minutes, 0.0))
    gc.collect()
    curve = read_curve(out / "metrics.csv", step)
    result = {"arm": arm, "steps": step, "train_minutes": curve[-1]["train_min"] if curve else 0.0,
              "final_eval_loss": el, "final_eval_acc": ea, "record_seconds": record_s,
              "wall_seconds_this_process": round(time.time() - t_wall, 1), "launches_this_process": launches,
              "checkpoint": str(latest)}
    done.write_text(json.dumps(result, indent=1) + "\n")
    log(f"[{arm}] done: {step} steps, {result['train_minutes']:.2f} training minutes, held-out ELBO {el:.4f}, "
        f"acc {ea:.4f}")
    return result


# ---------------------------------------------------------------------------------------------------- summary
def summarise(a: argparse.Namespace, arms: list[str], split: dict, results: Path) -> dict:
    """``runs.json`` / ``runs.md`` / ``runs.png`` and ``<arm>-metrics.csv`` in ``results`` for the finished arms."""
    results.mkdir(parents=True, exist_ok=True)
    per = {}
    for arm in arms:
        out = Path(a.work) / arm
        if not (out / "done.json").is_file():
            continue
        done = json.loads((out / "done.json").read_text())
        curve = read_curve(out / "metrics.csv", done["steps"])
        pts = [{"step": p["step"], "train_min": p["train_min"], "eval_loss": p["eval_loss"],
                "eval_acc": p["eval_acc"]} for p in curve if p["eval_loss"] is not None]
        if not pts or pts[-1]["step"] != done["steps"]:
            pts.append({"step": done["steps"], "train_min": done["train_minutes"], "eval_loss": done["final_eval_loss"],
                        "eval_acc": done["final_eval_acc"]})
        per[arm] = {**done, "curve": pts}
        shutil.copyfile(out / "metrics.csv", results / f"{arm}-metrics.csv")
    targets = {m: alignment_target(per, m) for m in ("eval_loss", "eval_acc")}
    meta = {"command": a.command_line,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "minutes": a.minutes,
            "model": a.model, "split": split, "block_size": a.block_size, "batch_size": a.batch_size,
            "seq_len": a.seq_len, "lr": a.lr, "lora_lr": a.lora_lr, "warmup": a.warmup, "seed": a.seed,
            "eval_every": a.eval_every, "eval_t_points": a.eval_t_points,
            "trajectory": {"mode": a.trajectory_mode, "steps": a.trajectory_steps,
                           "threshold": a.trajectory_threshold},
            "torch_threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None,
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "notes": "train_min = summed step times (evaluation, saving and loading excluded); eval_loss = the "
                     "trainer's held-out block ELBO over a fixed t grid with fixed noise (comparable across arms and "
                     "objectives), eval_acc = masked-token accuracy; the last point is the final weights."}
    result = {"meta": meta, "arms": per, "alignment_target": targets}
    (results / "runs.json").write_text(json.dumps(result, indent=1) + "\n")
    (results / "runs.md").write_text(markdown(result))
    if per:
        plot(per, results / "runs.png")
    return result


def alignment_target_line(metric: str, t: dict) -> str:
    """One Markdown bullet of :func:`alignment_target`'s result ``t`` for ``metric``, without the verdict (the
    callers append theirs)."""
    return (f"- {metric}: base final {_f(t['base_final'], 4)} after {_f(t['base_minutes'], 2)} min, first reached at "
            f"{_f(t['base_minutes_to_reach'], 2)} min; align reaches it at {_f(t['aligned_minutes_to_reach'], 2)} "
            f"min; ratio {_f(t['ratio'], 3)}")


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = ["# Fixed-budget training arms (issue 26)", "", f"Command: `{m['command']}`  ",
             f"Date (UTC): {m['date_utc']}; budget {m['minutes']} training minutes per arm; start {m['model']}; "
             f"{m['split']['train_rows']} training / {m['split']['heldout_rows']} held-out examples; block "
             f"{m['block_size']}, batch {m['batch_size']}, seq-len {m['seq_len']}, lr {m['lr']:g} (LoRA scopes "
             f"{m['lora_lr']:g}), warmup {m['warmup']}, seed {m['seed']}; load average {m['load_average_1_5_15']}.  ",
             f"Notes: {m['notes']}", "",
             "| arm | steps | training min | trajectory recording s | final held-out ELBO | final masked acc |",
             "|---|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        lines.append(f"| {arm} | {r['steps']} | {_f(r['train_minutes'], 2)} | {_f(r['record_seconds'], 0)} | "
                     f"{_f(r['final_eval_loss'], 4)} | {_f(r['final_eval_acc'], 4)} |")
    lines += ["", "Alignment target (the base's final quality reached with alignment in <= 0.5 x the base's training "
              "minutes to it; first evaluated point at least as good, for both arms):", ""]
    for metric, t in result["alignment_target"].items():
        lines.append(f"{alignment_target_line(metric, t)}; pass: {t['pass']}")
    return "\n".join(lines) + "\n"


def plot(per: dict, path: Path) -> None:
    """PNG: held-out ELBO (left) and masked-token accuracy (right) against training minutes, one line per arm."""
    fig, axes = bc.two_panels((11, 4.2))
    for ax, key, label in ((axes[0], "eval_loss", "held-out block ELBO (lower is better)"),
                           (axes[1], "eval_acc", "held-out masked-token accuracy")):
        for arm, r in per.items():
            pts = [(p["train_min"], p[key]) for p in r["curve"] if p.get(key) is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=arm)
        ax.set_ylabel(label)
    bc.write_panels(fig, axes, path, "training minutes", "Fixed-budget arms: held-out quality against training minutes")


def parse_arms(text: str) -> list[str]:
    """``"base,align,full"`` -> ``["base", "align"]`` (aliases resolved, order kept, duplicates dropped).

    Raises:
        RunsError: an unknown arm or an empty list (names ``--arms``).
    """
    arms = []
    for x in (t.strip() for t in text.split(",")):
        if not x:
            continue
        if x not in ARMS:
            raise RunsError(f"--arms: unknown arm {x!r} (one of {', '.join(ARMS)})")
        x = ALIASES.get(x, x)
        if x not in arms:
            arms.append(x)
    if not arms:
        raise RunsError("--arms: no arm given")
    return arms


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--work", required=True, help="working directory: the split, one directory per arm")
    p.add_argument("--data", required=True, help="distilled JSONL (unmask distill-data output)")
    p.add_argument("--heldout", required=True, help="held-out JSONL; its prompts are removed from --data")
    p.add_argument("--minutes", type=float, required=True, help="training minutes per arm (the same for all)")
    p.add_argument("--arms", default="base,align,trajectory,freeze_ffn,qk_only,lora,mask_lora",
                   help=f"comma-separated, from {', '.join(ARMS)} (full = base)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the common start checkpoint")
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help="where the summary and metrics CSVs go")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-lr", type=float, default=5e-4, help="learning rate of the lora and mask_lora arms")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=1_000_000, help="a step cap besides the budget")
    p.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every N steps")
    p.add_argument("--eval-t-points", type=int, default=5, help="noise levels of the held-out ELBO")
    p.add_argument("--save-every", type=int, default=50, help="resume checkpoints every N steps (the last kept)")
    p.add_argument("--teacher-kl", type=float, default=None,
                   help="KL weight (default: 1.0 when the data stores teacher top-k, as the recipe; else 0)")
    p.add_argument("--teacher", default=None, help="in-process KL teacher (only with --teacher-kl and no top-k)")
    p.add_argument("--align-weight", type=float, default=10.0)
    p.add_argument("--trajectory-mode", default="entropy", choices=["engine", "entropy"])
    p.add_argument("--trajectory-steps", type=int, default=8)
    p.add_argument("--trajectory-threshold", type=float, default=0.9)
    return p


def main(argv: list[str] | None = None, log=print) -> int:
    from unmask.training.trainer import TrainError

    a = add_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args(argv)
    a.command_line = " ".join(["python benchmarks/methods_runs.py"] + (sys.argv[1:] if argv is None else argv))
    try:
        if not (math.isfinite(a.minutes) and a.minutes > 0):
            raise RunsError(f"--minutes: must be > 0, got {a.minutes}")
        arms = parse_arms(a.arms)
        work = Path(a.work).expanduser()
        a.work = str(work)
        train, heldout, split = split_data(Path(a.data).expanduser(), Path(a.heldout).expanduser(), work)
        log(f"split: {split['train_rows']} training, {split['heldout_rows']} held-out examples "
            f"({split['removed_from_data']} held-out prompts removed from --data)")
        for arm in arms:
            run_arm(arm, a, train, heldout, split["teacher_top_k"], log)
            summarise(a, arms, split, Path(a.results).expanduser())
        log(f"wrote {Path(a.results) / 'runs.json'}, .md, .png")
    except (RunsError, TrainError) as exc:
        return bc.script_error("methods_runs", exc)
    return 0


if __name__ == "__main__":
    bc.run_script(main)
