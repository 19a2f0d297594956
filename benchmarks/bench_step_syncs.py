"""Host syncs and aten ops outside the model forward per BATCH step (issue 42), counted on a CPU under fake CUDA.

For plain (quota), threshold, multi-block, CFG and speculative decoding (``tests/decoding_paths.py``'s paths and
tiny checkpoints), batches of 1, 8 and 32 requests decode ``--max-tokens`` tokens each in one ``LLM.generate`` call
(``max_batch_size`` = the batch, so every request runs in the same steps). :class:`sync_counter.SyncCounter`
(``tests/sync_counter.py``) counts what would block the host on a GPU, by kind, and the aten ops dispatched outside
``LoadedModel.hidden_states`` / ``LoadedModel.logits`` (the forward); a batch step is one call of ``--step-hook``
(``Denoiser.step``; name the new one if a rewrite moves it).

Figures per row: ``syncs / step`` = every sync of the ``generate`` call (request setup and output included) / batch
steps; ``in-step syncs`` = the median over steps of the syncs inside ``Denoiser.step``; ``ops outside / step`` = aten
ops outside the forward during the call / batch steps, and its growth from batch 1 to the largest batch (issue 42's
target: <= 1.2x); ``device ops`` = those ops that touch a device tensor (the kernel launches a GPU would see; the
rest is host bookkeeping on CPU tensors). The ``reference`` row is the frozen vectorized loop (``benchmarks/reference_loop.py``) on the
plain path's settings (a step = one forward): what a step without per-lane Python costs. Counts, not times: the
same on any machine for the same code.

    .venv/bin/python benchmarks/bench_step_syncs.py [--paths quota,threshold] [--batch 1 8 32]

Writes ``benchmarks/results/bench_step_syncs.{json,md}``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import shlex
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import decoding_paths as dp  # noqa: E402
from device_tags import Patches, fake_cuda  # noqa: E402
from sync_counter import SyncCounter  # noqa: E402

# the paths of issue 42's table (tests/decoding_paths.py names)
PATHS = {"plain": "quota", "threshold": "threshold", "multi-block": "multi-block", "cfg": "cfg",
         "speculative": "speculative-greedy",
         # the plain table step (engine/plain_batch.py): a bidirectional model's cache-less default, Fast-dLLM's prefix
         "table": "bidirectional-cache-none", "table-prefix": "bidirectional-cache-prefix", "reference": None}
STEP_HOOK = "unmask.engine.denoiser:Denoiser.step"  # one batch step of the engine
REFERENCE = "reference"  # benchmarks/reference_loop.py on the plain path's settings: what a vectorized step costs



def hook(spec: str) -> tuple[type, str]:
    """``module:Class.method`` -> ``(Class, "method")`` (the method the counter wraps)."""
    module, _, qual = spec.partition(":")
    cls_name, _, method = qual.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    if method not in cls.__dict__:
        raise SystemExit(f"bench_step_syncs: error: {spec}: {cls_name} defines no {method!r}")
    return cls, method


def count(checkpoint: Path, path: dp.DecodingPath, batch: int, max_tokens: int,
          step_hook: str = STEP_HOOK) -> dict:
    """One ``generate`` of ``batch`` requests on ``path`` under fake CUDA: syncs and ops per batch step (a call of
    ``step_hook``)."""
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import LoadedModel, load_model

    step_cls, step_name = hook(step_hook)

    patches = Patches()
    try:
        with fake_cuda(patches):
            llm = LLM(load_model(checkpoint, device="cuda", dtype="float32"), max_batch_size=max(16, batch))
            params = SamplingParams.from_flat(**dict(path.params, max_tokens=max_tokens, ignore_eos=True))
            prompts = [dp.PROMPTS[i % len(dp.PROMPTS)] for i in range(batch)]
            # warm-up: first-call work (tokenizer caches, lazy imports) and every prompt's shape once (the canvas-shape
            # caches: a batch of 1 would otherwise run warm and a batch of 8 meet two shapes it never saw)
            llm.generate(list(dict.fromkeys(prompts)), params)
            with SyncCounter("cuda") as c, c.forward_methods(LoadedModel, ("hidden_states", "logits")), \
                    c.step_method(step_cls, step_name):
                outs = llm.generate(prompts, params)
    finally:
        patches.close()
    return _summary(c, batch, sum(o.outputs[0].nfe for o in outs), in_step=True)


def count_reference(checkpoint: Path, batch: int, max_tokens: int) -> dict:
    """The frozen reference loop (``benchmarks/reference_loop.py``, cache none, quota at block 4, one token per step:
    the ``plain`` path's settings) on ``batch`` copies of one prompt under fake CUDA; a step is one forward."""
    from reference_loop import ReferenceConfig, reference_generate
    from unmask.engine.model import LoadedModel, load_model

    patches = Patches()
    try:
        with fake_cuda(patches):
            model = load_model(checkpoint, device="cuda", dtype="float32")
            ids = model.tokenizer.encode(dp.PROMPTS[0], add_special_tokens=False)
            prompts = torch.tensor([ids] * batch, dtype=torch.long)
            cfg = ReferenceConfig(max_tokens=max_tokens, block_size=4)
            with SyncCounter("cuda") as c, c.forward_methods(LoadedModel, ("hidden_states", "logits")):
                with c.step_method(LoadedModel, "hidden_states"):  # one record per forward (a step)
                    reference_generate(model, prompts, cfg)
    finally:
        patches.close()
    return _summary(c, batch, batch * len(c.steps), in_step=False)


def _summary(c: SyncCounter, batch: int, request_steps: int, in_step: bool) -> dict:
    steps = len(c.steps)
    per_step = [sum(s["syncs"].values()) for s in c.steps]
    by_kind = Counter()
    for s in c.steps:
        by_kind.update(s["syncs"])
    return {"batch": batch, "batch_steps": steps, "request_steps": request_steps, "syncs": dict(c.syncs),
            "total_syncs": c.total, "syncs_per_step": round(c.total / max(steps, 1), 2),
            "in_step_syncs_median": statistics.median(per_step) if in_step and steps else None,
            "in_step_syncs_max": max(per_step, default=0) if in_step else None,
            "in_step_by_kind": dict(by_kind) if in_step else None,
            "ops_outside": c.ops_outside, "ops_inside": c.ops_inside,
            "ops_outside_per_step": round(c.ops_outside / max(steps, 1), 1),
            "in_step_ops_outside_median": (statistics.median(s["ops_outside"] for s in c.steps)
                                           if in_step and steps else None),
            "device_ops_outside": c.device_ops_outside,
            "device_ops_outside_per_step": round(c.device_ops_outside / max(steps, 1), 1)}


def markdown(rows: list[dict], command: str) -> str:
    lines = ["# Host syncs and ops outside the forward per batch step (fake CUDA on a CPU; counts, not times)", "",
             f"`{command}`", "",
             "| path | batch | batch steps | syncs / step | in-step syncs (median, max) | ops outside fwd / step | "
             "growth vs batch 1 | device ops outside fwd / step (growth) | syncs by kind (whole call) |",
             "|---|---|---|---|---|---|---|---|---|"]
    first = min(x["batch"] for x in rows)
    base = {r["path"]: r["ops_outside_per_step"] for r in rows if r["batch"] == first}
    dev_base = {r["path"]: r["device_ops_outside_per_step"] for r in rows if r["batch"] == first}
    for r in rows:
        growth = r["ops_outside_per_step"] / base[r["path"]] if base.get(r["path"]) else float("nan")
        dev = r["device_ops_outside_per_step"]
        dev_growth = dev / dev_base[r["path"]] if dev_base.get(r["path"]) else float("nan")
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["syncs"].items()))
        in_step = ("-" if r["in_step_syncs_median"] is None
                   else f"{r['in_step_syncs_median']}, {r['in_step_syncs_max']}")
        lines.append(f"| {r['path']} | {r['batch']} | {r['batch_steps']} | {r['syncs_per_step']} | {in_step} | "
                     f"{r['ops_outside_per_step']} | {growth:.2f}x | {dev} ({dev_growth:.2f}x) | {kinds} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {list(PATHS)}")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--engine-label", default=None, help="what engine is measured (recorded)")
    ap.add_argument("--step-hook", default=STEP_HOOK, help="module:Class.method called once per batch step")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_step_syncs"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    by_name = {p.name: p for p in dp.PATHS}
    names = args.paths.split(",")
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        ap.error(f"--paths: unknown {unknown}; choose from {list(PATHS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = dp.write_checkpoints(Path(tmp))
        for name in names:
            path = by_name[PATHS[name]] if name != REFERENCE else None
            for b in args.batch:
                row = (count_reference(dirs["causal"], b, args.max_tokens) if path is None
                       else count(dirs[path.checkpoint], path, b, args.max_tokens, args.step_hook))
                row["path"] = name
                rows.append(row)
                print(f"{name:12s} batch {b:2d}: {row['syncs_per_step']:7.2f} syncs/step, "
                      f"{row['ops_outside_per_step']:8.1f} ops outside/step ({row['batch_steps']} steps) "
                      f"{row['syncs']}", flush=True)
    import unmask.engine

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join([".venv/bin/python", "benchmarks/bench_step_syncs.py",
                          *(argv if argv is not None else sys.argv[1:])])
    meta = {"command": command, "torch": torch.__version__, "engine": args.engine_label or
            str(Path(unmask.engine.__file__).parent), "max_tokens": args.max_tokens,
            "model": "tests/decoding_paths.py tiny checkpoints", "step_hook": args.step_hook}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, command) + f"\nEngine measured: {meta['engine']}.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
