"""Server memory of the default model against its parent alone (issue 25, "memory"): the memory phase of
``bench_default.py`` on its own, without the timed rows (so it can run on a loaded machine: RSS does not depend on
the load).

Starts ``unmask serve PARENT`` (the A2D conversion alone) and ``unmask serve`` (no MODEL: the conversion + the shipped
mask-row adapter, or ``--served DIR``), ``--repeats`` times each, alternating; each server gets the same
``--requests`` chat requests (greedy ones, then one plain-diffusion request at block 4, threshold 0.3: the adapter
path) and is read at three points: VmRSS when ``/health`` first answers ("loaded"), VmRSS after the requests, and
VmHWM (peak RSS over the server's life: start-up included). MB = 10**6 bytes; medians over the repeats.
Writes ``benchmarks/results/<--out-name>.{json,md}`` (default ``bench_memory``).

    .venv/bin/python benchmarks/bench_memory.py --repeats 2
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
from bench_default import TARGETS, judge_memory, server_memory  # noqa: E402

FIELDS = ("rss_loaded_mb", "rss_after_mb", "peak_rss_mb")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4, help="requests each server gets (the last one diffusion)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--served", default=None, metavar="DIR", help="serve DIR instead of the default (no MODEL)")
    ap.add_argument("--out-name", default="bench_memory")
    args = ap.parse_args(argv)
    from unmask.cli.serve import default_model
    from unmask.training.realmodel import ensure_default_converted

    parent_dir = str(ensure_default_converted())
    served_what = f"--served {args.served}" if args.served else default_model()[2]
    env = bc.environment(args.threads)
    prompts = bc.grid_prompts(max(1, args.requests - 1))
    bodies = [{"messages": [{"role": "user", "content": p["prompt"]}], "max_tokens": args.max_tokens,
               "temperature": 0} for p in prompts]
    bodies.append({**bodies[0], "block_size": 4, "threshold": 0.3})
    runs: dict[str, list[dict]] = {"parent": [], "default": []}
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for rep in range(args.repeats):
            for name, serve_args in (("parent", [parent_dir]), ("default", [args.served] if args.served else [])):
                runs[name].append(server_memory(serve_args, bodies, args.threads, Path(tmp) / f"{name}{rep}.log"))
                print(f"repeat {rep} {name}: " + ", ".join(f"{k} {runs[name][-1][k]:.0f}" for k in FIELDS),
                      flush=True)
    med = {name: {k: bc.median([r[k] for r in rs]) for k in FIELDS} for name, rs in runs.items()}
    judged = judge_memory(med["parent"], med["default"])
    data = {"environment": env, "served": served_what, "requests": len(bodies), "max_tokens": args.max_tokens,
            "targets": {k: TARGETS[k] for k in ("adapter_extra_rss_mb", "default_peak_rss_mb")},
            "runs": runs, "median": med, **judged}
    p, d = med["parent"], med["default"]
    rows = [["unmask serve PARENT (parent alone)", p["rss_loaded_mb"], p["rss_after_mb"], p["peak_rss_mb"], "", ""],
            ["unmask serve (parent + adapter)", d["rss_loaded_mb"], d["rss_after_mb"], d["peak_rss_mb"],
             f"peak < {TARGETS['default_peak_rss_mb']:.0f} MB", "pass" if judged["default_peak_pass"] else "FAIL"],
            ["adapter's extra RSS", "", judged["adapter_extra_rss_mb"], judged["adapter_extra_peak_mb"],
             f"<= {TARGETS['adapter_extra_rss_mb']:.0f} MB", "pass" if judged["adapter_extra_pass"] else "FAIL"]]
    md = (f"Served default: {served_what}. Each server: {len(bodies)} chat requests ({len(bodies) - 1} greedy, 1 "
          f"plain diffusion b4 threshold 0.3), max {args.max_tokens} tokens, {args.threads} threads; MB = 10^6 "
          f"bytes; medians of {args.repeats} servers each (RSS does not depend on the machine's load).\n\n"
          + bc.markdown_table(["server", "RSS loaded", "RSS after requests", "peak RSS (VmHWM)", "target", "result"],
                              rows))
    bc.write_results(args.out_name, data, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
