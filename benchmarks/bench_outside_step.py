"""The engine's host time outside the denoising step (issue 42): per ``LLM.generate``, the wall time minus the time
inside ``Denoiser.step`` - building and checking the requests (plan, layout, tokenizer, tensors), admission (memory
reading, fairness), the scheduler's own per-step work, the events' hand-back and the final outputs - at batch 1, 8
and 32, on the tiny prefix-causal model of ``benchmarks/bench_vs_reference.py`` with its quota settings (greedy,
``ignore_eos``, 32 tokens, block 8, 16 steps, no cache).

With ``--base COMMIT`` the same measurement runs on that commit's engine too (``git archive`` of its package
directories into a temporary ``unmask`` package put first on ``sys.path``), in separate processes that alternate
round by round with the measured side's, so that both see the same machine load: medians of every timed run of
each side, and the ratio base / measured (> 1: the measured side spends less time outside the step). The measured
side is the working tree, or ``--target COMMIT`` (e.g. one change alone on a tree others are editing).

    .venv/bin/python benchmarks/bench_outside_step.py --base HEAD --rounds 4 --repeats 8

Writes ``benchmarks/results/bench_outside_step.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "cli", "clients", "training", "default_adapter")  # the unmask.* subpackages


def worker(batches: list[int], repeats: int) -> dict:
    """``{batch: [[total s, outside s], ...]}`` of ``repeats`` timed ``generate`` calls per batch (one untimed
    first), in this process's ``unmask`` (whatever ``sys.path`` finds first)."""
    sys.path.insert(1, str(ROOT / "tests"))
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import bench_common as bc
    import bench_vs_reference as bvr
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.denoiser import Denoiser

    bc.set_threads(1)
    inside = [0.0]
    step = Denoiser.step

    def timed_step(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    Denoiser.step = timed_step
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, setting, make_prompts = bvr.load("tiny-causal", Path(tmp))
        llm = LLM(model, max_batch_size=max(batches))
        steps = next(s for name, s, _ in setting.modes if name == "quota")
        params = SamplingParams.from_flat(temperature=0, speculative=False, block_size=setting.block_size,
                                          steps=steps, cache="none", ignore_eos=True, max_tokens=setting.max_tokens)
        for b in batches:
            ids = make_prompts(model, b, setting.prompt_len).tolist()
            llm.generate(ids, params)
            runs = []
            for _ in range(repeats):
                inside[0] = 0.0
                t0 = time.perf_counter()
                llm.generate(ids, params)
                total = time.perf_counter() - t0
                runs.append([total, total - inside[0]])
            out[b] = runs
    return out


def checkout(commit: str, into: Path) -> Path:
    """``into/unmask/<package>``: the package directories of ``commit`` (``git archive``); returns ``into``."""
    pkg = into / "unmask"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    archive = into / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit, *PACKAGES], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(pkg, filter="data")
    return into


def short(commit: str) -> str:
    """The abbreviated hash of ``commit``."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit], check=True, capture_output=True,
                          text=True).stdout.strip()


def run_side(path: Path | None, batches: list[int], repeats: int) -> dict:
    """One worker process (``path``: a checkout put first on ``sys.path``; None: the working tree)."""
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]) if sys.argv[1] else None; "
            f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_outside_step as b; "
            "print(json.dumps(b.worker(json.loads(sys.argv[2]), int(sys.argv[3]))))")
    res = subprocess.run([sys.executable, "-c", code, str(path or ""), json.dumps(batches), str(repeats)],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def main(argv=None) -> int:
    import bench_common as bc

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=8, help="timed generate calls per batch per round and side")
    ap.add_argument("--rounds", type=int, default=4, help="processes per side, alternating with the other side")
    ap.add_argument("--base", default=None, help="a commit to measure in the same run (e.g. HEAD)")
    ap.add_argument("--target", default=None, help="the measured commit (default: the working tree)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {}
        for role, commit in (("base", args.base), ("target", args.target)):
            if commit:
                sides[f"{role} {short(commit)}"] = checkout(commit, Path(tmp) / role)
        if not args.target:
            sides["working tree"] = None
        runs: dict[str, dict[int, list]] = {name: {b: [] for b in args.batch} for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                for b, values in run_side(sides[name], args.batch, args.repeats).items():
                    runs[name][b] += values
                print(f"round {r + 1}/{args.rounds}: {name} done", flush=True)
    rows = []
    for b in args.batch:
        row = {"batch": b}
        for name in sides:
            row[name] = {"total_ms": 1e3 * bc.median([t for t, _ in runs[name][b]]),
                         "outside_ms": 1e3 * bc.median([o for _, o in runs[name][b]]), "runs": runs[name][b]}
        if args.base:
            base, work = (row[name]["outside_ms"] for name in sides)
            row["outside_ratio_base_over_work"] = base / work
        rows.append(row)
    header = ["batch"] + [f"{name}: {what} (ms)" for name in sides for what in ("generate", "outside step")]
    header += ["outside: base / measured"] if args.base else []
    table = [[r["batch"]] + [r[name][k] for name in sides for k in ("total_ms", "outside_ms")]
             + ([r["outside_ratio_base_over_work"]] if args.base else []) for r in rows]
    md = ("Host time outside `Denoiser.step` per `LLM.generate` (tiny-causal, quota: greedy, ignore_eos, 32 tokens, "
          f"block 8, 16 steps, no cache); medians of {args.rounds} x {args.repeats} timed calls per side, the sides "
          "in alternating processes (one intra-op thread each).\n\n" + bc.markdown_table(header, table))
    bc.set_threads(1)  # as the workers ran (the environment record reads this process's setting)
    data = {"settings": vars(args), "environment": bc.environment(1), "rows": rows}
    return bc.report("bench_outside_step", data, md)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_common

    bench_common.run_script(main)
