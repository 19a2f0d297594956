"""Host syncs per request-step, counted on a CPU under fake CUDA (``tests/device_tags.py``): for each decoding path
of ``tests/decoding_paths.py``, batches of 1 and 8 requests decode on a tiny model and every operation that would
block the host on a GPU is counted by kind (device-to-host copies, value reads such as ``.item()``/``.tolist()``,
data-dependent shapes such as ``nonzero``, host-to-device copies of pageable memory).

Counts, not times: the same on any machine for the same code. The figure is syncs / (requests x steps), where a
request's steps are its NFE (``usage.nfe``). Writes ``benchmarks/results/bench_host_syncs.{json,md}``.

    python benchmarks/bench_host_syncs.py [--paths quota,threshold] [--batch 1 8]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import decoding_paths as dp  # noqa: E402
from device_tags import Patches, fake_cuda  # noqa: E402



def count(checkpoint: Path, path: dp.DecodingPath, batch: int) -> dict:
    from unmask.engine import LLM, Constraint, SamplingParams
    from unmask.engine.model import load_model

    patches = Patches()
    try:
        with fake_cuda(patches) as mode:
            llm = LLM(load_model(checkpoint, device="cuda", dtype="float32"))
            kw = dict(path.params, max_tokens=12, ignore_eos=not path.constrained)
            if path.constrained:
                kw.update(constraint=Constraint("json_schema", dp.SCHEMA), max_tokens=48)
            prompts = [dp.PROMPTS[i % len(dp.PROMPTS)] for i in range(batch)]
            mode.syncs.clear()
            outs = llm.generate(prompts, SamplingParams.from_flat(**kw))
            syncs = dict(mode.syncs)
    finally:
        patches.close()
    request_steps = sum(o.outputs[0].nfe for o in outs)
    total = sum(syncs.values())
    return {"path": path.name, "batch": batch, "request_steps": request_steps, "syncs": syncs, "total": total,
            "per_request_step": round(total / max(request_steps, 1), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default=None, help="comma-separated path names (default: every path)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_host_syncs"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    wanted = set(args.paths.split(",")) if args.paths else None
    paths = [p for p in dp.PATHS if wanted is None or p.name in wanted]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = dp.write_checkpoints(Path(tmp))
        for path in paths:
            for b in args.batch:
                rows.append(count(dirs[path.checkpoint], path, b))
                print(f"{path.name:28s} batch {b:2d}: {rows[-1]['per_request_step']:6.2f} syncs per request-step "
                      f"{rows[-1]['syncs']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/bench_host_syncs.py " + " ".join(argv or sys.argv[1:]),
            "torch": torch.__version__, "model": "tests/decoding_paths.py tiny checkpoints, 12 new tokens"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Host syncs per request-step (fake CUDA on a CPU; counts, not times)", "",
             f"`{meta['command']}`", "", "| path | batch | syncs / request-step | by kind |", "|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['batch']} | {r['per_request_step']} | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(r['syncs'].items()))} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
