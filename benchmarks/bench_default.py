"""The default model's speed and memory against its parent and llama.cpp, in one run (issue 25, "Must show").

Same held-out grid prompts (``benchmarks/data/eval_grid_ids.json``, chat template), batch 1, greedy, at most
``--max-tokens`` new tokens, stopping at EOS; every mode decodes the whole prompt set once per repeat, the modes
interleaved (a shared machine's load drifts); tokens/s = median over repeats of the set's tokens / wall seconds.

Rows:

* ``transformers greedy``: the parent (the A2D conversion loaded as a causal LM, float32, KV cache, batch 1);
* ``llama.cpp``: ``llama-bench`` ``tg<max-tokens>`` on the same GGUF (``--llama-bench``; default the binary that
  ``benchmarks/build_llama_bench.sh`` builds, skipped with a note when absent);
* ``engine block 1`` with ``--weights`` ``auto`` (what the server runs: for this Q4_1 GGUF the GGUF's own 4-bit
  blocks as int4 layers, the Q8_0 LM head fp16-packed; engine/packed_weights.py), ``fp16`` (fbgemm-packed),
  ``int8`` and ``int4`` (everything quantized, LM head int8; engine/lowbit.py) of the parent;
* ``engine block 1 tg``: the same four, measured as ``llama-bench`` measures ``tg``: generation only, the prompt's
  processing not counted (:func:`engine_tg`). The block-1 target against llama.cpp is judged on this row, the same
  quantity on both sides; the end-to-end rows above include each prompt's prefill and per-request work, which
  ``llama-bench -p 0 -n N`` never does;
* ``speculative``: the served default (``unmask serve`` with no MODEL: the conversion + mask-row adapter, in the
  weight format it is served in; ``--served DIR`` measures another adapter), verified speculative decoding - answers
  must be the served parent's block-1 answers;
* ``speculative, block B, BR branches`` (``--spec-configs B:BR,...``): the same with another draft block and
  number of fallback groups (fewer rows per verified step; informative, no target);
* ``diffusion b4 t<τ>``: plain diffusion of the same adapter model, block 4, threshold τ (``--thresholds``);
* ``diffusion b<k> quota``: the same, block k, one step per block (``steps = max_tokens / k``: k tokens per
  forward; ``--quota-blocks``); at block 2 the block's first token comes from the committed row (the parent's
  prediction, logit shift) and only the second from a mask row;
* memory: ``unmask serve PARENT`` vs ``unmask serve [DIR]`` (the default: parent + adapter), each given the same few
  requests: RSS after them (``/proc/PID/status`` VmRSS) and peak RSS (VmHWM).

Each speed row has tokens/s, tokens per forward (TPF), its ratio to the engine block 1 in the served weight format and
to llama.cpp, the share of answers identical to the parent's (the served block 1), answer accuracy on the
checkable prompts (``quality_metrics.answer_match``) and the issue-25 target as pass/fail (:data:`TARGETS`).
Writes ``benchmarks/results/bench_default.{json,md,png}``.

    benchmarks/build_llama_bench.sh     # once: llama-bench into ~/.cache/unmask/llama.cpp/bin/
    .venv/bin/python benchmarks/bench_default.py --prompts 36 --max-tokens 48 --repeats 3 --threads 2   # idle machine

``--threads 1`` (and ``OMP_NUM_THREADS=1``) on a shared machine.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import quality_metrics as qm  # noqa: E402
from bench_ar import hf_greedy, llama_bench  # noqa: E402

#: the parent's --weights values measured; "auto" is what `unmask serve` runs (on the Q4_1 GGUF: its int4 case)
FORMATS = ("auto", "fp16", "int8", "int4")
LLAMA_BENCH = Path.home() / ".cache" / "unmask" / "llama.cpp" / "bin" / "llama-bench"
# issue 25's targets; MB = 10**6 bytes
TARGETS = {"block1_vs_llama_cpp": 0.5, "spec_vs_block1": 1.3, "spec_tpf": 1.6, "diffusion_tpf": 2.0,
           "diffusion_accuracy_vs_parent": 0.7, "adapter_extra_rss_mb": 50.0, "default_peak_rss_mb": 1440.0}


def run_hf(hf, llm, prompts: list[dict], max_tokens: int, eos: list[int]) -> dict:
    """:func:`bench_common.run_mode` for transformers greedy (``llm`` gives the chat template and tokenizer)."""
    outs, secs = [], 0.0
    for p in prompts:
        ids = llm.apply_chat_template([{"role": "user", "content": p["prompt"]}])
        sec, toks = hf_greedy(hf, ids, max_tokens, eos)
        secs += sec
        outs.append(SimpleNamespace(token_ids=toks, nfe=len(toks),
                                    text=llm.tokenizer.decode(toks, skip_special_tokens=True)))
    return {"seconds": secs, "tokens": sum(len(o.token_ids) for o in outs), "nfe": sum(o.nfe for o in outs),
            "outs": outs}


def engine_tg(llm, prompts: list[dict], n: int, params_for) -> dict:
    """Generation-only tokens/s of ``llm``, as ``llama-bench`` ``tg<n>`` measures it: for each prompt (chat
    template, batch 1), the wall time of ``n + 1`` generated tokens (``ignore_eos``) minus that of 1 token, i.e. of
    ``n`` decoding steps after the prompt's forward. ``params_for(max_tokens)`` builds the SamplingParams.
    ``{"seconds": summed decode seconds, "tokens": n * len(prompts)}``."""
    import time

    secs = 0.0
    for p in prompts:
        ids = llm.apply_chat_template([{"role": "user", "content": p["prompt"]}])
        t0 = time.perf_counter()
        llm.generate([ids], params_for(1))
        t1 = time.perf_counter()
        o = llm.generate([ids], params_for(n + 1))[0].outputs[0]
        t2 = time.perf_counter()
        if len(o.token_ids) != n + 1:
            raise RuntimeError(f"tg: expected {n + 1} tokens with ignore_eos, got {len(o.token_ids)}")
        secs += (t2 - t1) - (t1 - t0)
    return {"seconds": secs, "tokens": n * len(prompts)}


def accuracy(outs, prompts: list[dict]) -> float:
    """Answer accuracy over the checkable prompts (those with an ``answer``): ``quality_metrics.answer_match``, the
    extracted-answer rule of the results tables (whole-answer exact match scored 0 for every decoder, the parent
    included, because the answers are sentences); NaN when there are none."""
    pairs = [(o.text if hasattr(o, "text") else o, p["answer"]) for o, p in zip(outs, prompts)
             if p.get("answer") is not None]
    return sum(qm.answer_match(t, a) for t, a in pairs) / len(pairs) if pairs else float("nan")


def server_memory(serve_args: list[str], bodies: list[dict], threads: int, log_path: Path) -> dict:
    """Start ``unmask serve *serve_args``, send ``bodies`` to ``/v1/chat/completions`` one after another and read
    its memory: ``{"rss_loaded_mb", "rss_after_mb", "peak_rss_mb"}`` (MB = 10**6 bytes; VmRSS after load, VmRSS
    after the requests, VmHWM).

    Raises:
        RuntimeError: the server did not start, or a request did not answer 200 (names the body's index).
    """
    import httpx

    proc, base = bc.start_server([*serve_args, "--threads", str(threads), "--max-batch-size", "4",
                                  "--log-level", "warning"], threads, log_path)
    mb = lambda field: bc.proc_status_kib(proc.pid, field) * 1024 / 1e6  # noqa: E731
    try:
        out = {"serve_args": serve_args, "rss_loaded_mb": mb("VmRSS")}
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        for i, body in enumerate(bodies):
            r = httpx.post(base + "/v1/chat/completions", json={"model": model, **body}, timeout=600)
            if r.status_code != 200:
                raise RuntimeError(f"request {i} to unmask serve {' '.join(serve_args)}: {r.status_code} {r.text[:300]}")
        out.update(rss_after_mb=mb("VmRSS"), peak_rss_mb=mb("VmHWM"), model=model, requests=len(bodies))
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _layers(model) -> str:
    """``int4 (120 int4 + 1 fp16 layers)``: a loaded model's weight format and what it packed."""
    parts = " + ".join(f"{n} {k}" for k, n in sorted(model.packed_layers.items()))
    return f"{model.weight_format} ({parts} layers)" if parts else model.weight_format


def judge(summary: dict, served_fmt: str, llama_tps: float | None) -> None:
    """Add to each mode's entry of ``summary`` (``{mode: {"tokens_per_s", "tpf", "identical_to_parent",
    "accuracy"}}``, with ``hf`` = the parent, ``block1-<served_fmt>`` = the reference and ``tg-<fmt>`` the
    generation-only rows) its ratios ``x_block1`` (end-to-end rows against the end-to-end reference, tg rows against
    the tg reference) and ``x_llama_cpp`` (None without ``llama_tps``) and, for the modes issue 25 sets a target
    for, ``target`` (text) and ``pass`` (None when it cannot be judged: no llama.cpp figure). The block-1 target is
    judged on ``tg-<served_fmt>``: llama-bench's tg figure counts generation only."""
    ref_tps = summary[f"block1-{served_fmt}"]["tokens_per_s"]
    tg_ref = summary.get(f"tg-{served_fmt}", {}).get("tokens_per_s")
    parent_acc = summary["hf"]["accuracy"]
    for m, s in summary.items():
        s["x_block1"] = s["tokens_per_s"] / (tg_ref if m.startswith("tg-") else ref_tps)
        s["x_llama_cpp"] = s["tokens_per_s"] / llama_tps if llama_tps else None
        if m == f"tg-{served_fmt}":
            s["target"] = f">= {TARGETS['block1_vs_llama_cpp']}x llama.cpp"
            s["pass"] = s["x_llama_cpp"] >= TARGETS["block1_vs_llama_cpp"] if llama_tps else None
        elif m == "spec":
            s["target"] = f">= {TARGETS['spec_vs_block1']}x block 1, parent's answers, TPF >= {TARGETS['spec_tpf']}"
            s["pass"] = (s["x_block1"] >= TARGETS["spec_vs_block1"] and s["identical_to_parent"] == 1.0
                         and s["tpf"] >= TARGETS["spec_tpf"])
        elif m.startswith("diffusion"):
            s["accuracy_vs_parent"] = s["accuracy"] / parent_acc if parent_acc else float("nan")
            s["target"] = (f"TPF >= {TARGETS['diffusion_tpf']}, accuracy >= "
                           f"{TARGETS['diffusion_accuracy_vs_parent']}x parent's")
            s["pass"] = (s["tpf"] >= TARGETS["diffusion_tpf"]
                         and s["accuracy_vs_parent"] >= TARGETS["diffusion_accuracy_vs_parent"])


def judge_memory(parent: dict, default: dict) -> dict:
    """The memory targets from two :func:`server_memory` results: the adapter's extra RSS after the same requests
    (<= 50 MB) and the default server's peak RSS (< 1440 MB)."""
    extra = default["rss_after_mb"] - parent["rss_after_mb"]
    return {"adapter_extra_rss_mb": extra, "adapter_extra_peak_mb": default["peak_rss_mb"] - parent["peak_rss_mb"],
            "adapter_extra_pass": extra <= TARGETS["adapter_extra_rss_mb"],
            "default_peak_pass": default["peak_rss_mb"] < TARGETS["default_peak_rss_mb"]}


def parse_spec_configs(text: str) -> list[tuple[int, int]]:
    """``"2:0,3:1"`` -> ``[(2, 0), (3, 1)]`` (draft block, fallback branches). Raises ValueError naming
    ``--spec-configs`` and the bad item: not ``B:BR`` integers, ``B < 2`` or ``BR`` outside ``0..B-1``."""
    out = []
    for item in (c.strip() for c in text.split(",") if c.strip()):
        try:
            b, br = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"--spec-configs: {item!r} is not B:BR (two integers)") from None
        if b < 2 or not 0 <= br < b:
            raise ValueError(f"--spec-configs: {item!r} needs a block B >= 2 and 0 <= BR <= B - 1 branches")
        out.append((b, br))
    return out


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "FAIL")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=36, help="first N prompts of the 60-prompt held-out grid")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quota-blocks", default="2", help="plain-diffusion block sizes decoded one step per block")
    ap.add_argument("--tg-prompts", type=int, default=4,
                    help="prompts of the generation-only (tg) rows: each generates --max-tokens after its prompt")
    ap.add_argument("--thresholds", default="0.9,0.7,0.5,0.3", help="plain-diffusion thresholds (block 4)")
    ap.add_argument("--spec-configs", default="", metavar="B:BR,...",
                    help="more speculative rows: draft block B with BR fallback branches each (e.g. 2:0,3:1); a "
                         "step forwards more rows the larger both are")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every row (llama.cpp -t too)")
    ap.add_argument("--llama-bench", default=str(LLAMA_BENCH), metavar="PATH",
                    help="llama-bench binary (benchmarks/build_llama_bench.sh builds it); skipped when absent")
    ap.add_argument("--memory-requests", type=int, default=4, help="requests each memory server gets")
    ap.add_argument("--no-memory", action="store_true", help="skip the two server memory measurements")
    ap.add_argument("--served", default=None, metavar="DIR",
                    help="the adapter (or A2D checkpoint) to measure as the served model (default: what `unmask "
                         "serve` serves with no MODEL: the recipe's trained default, else the shipped adapter)")
    ap.add_argument("--out-name", default="bench_default", help="result name under benchmarks/results/")
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    import torch
    from transformers import AutoModelForCausalLM

    from unmask.cli.serve import default_model
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import load_model
    from unmask.training.realmodel import ensure_default_converted, smollm2_gguf_path

    parent_dir = str(ensure_default_converted())
    if args.served is None:
        served_path, _, served_what = default_model()  # exactly what `unmask serve` with no MODEL serves
    else:
        served_path, served_what = args.served, f"--served {args.served}"
    env = bc.environment(args.threads)
    env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    block1 = {fmt: LLM(load_model(parent_dir, weights=fmt), max_batch_size=1) for fmt in FORMATS}
    served = LLM(load_model(served_path), max_batch_size=1)
    served_fmt = "auto"  # the served model is loaded as `unmask serve` loads it
    served_kind = _layers(served.model)
    hf = AutoModelForCausalLM.from_pretrained(parent_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = list(block1["fp16"].model.dllm.eos_token_ids)
    prompts = bc.grid_prompts(args.prompts)
    thresholds = [float(x) for x in args.thresholds.split(",") if x]
    quota_blocks = [int(x) for x in args.quota_blocks.split(",") if x]
    base = dict(max_tokens=args.max_tokens, temperature=0.0, seed=0)
    modes = {"hf": lambda ps, n: run_hf(hf, served, ps, n, eos)}
    for fmt, llm in block1.items():
        modes[f"block1-{fmt}"] = (lambda llm: lambda ps, n: bc.run_mode(
            llm, ps, SamplingParams.from_flat(**{**base, "max_tokens": n}, block_size=1, speculative=False)))(llm)
    modes["spec"] = lambda ps, n: bc.run_mode(served, ps, SamplingParams.from_flat(
        **{**base, "max_tokens": n}, speculative=True))  # block size: the served model's default
    try:
        spec_configs = parse_spec_configs(args.spec_configs)
    except ValueError as e:
        ap.error(str(e))
    for b, br in spec_configs:
        modes[f"spec-b{b}-br{br}"] = (lambda b, br: lambda ps, n: bc.run_mode(served, ps, SamplingParams.from_flat(
            **{**base, "max_tokens": n}, block_size=b, speculative=True, speculative_branches=br)))(b, br)
    for t in thresholds:
        modes[f"diffusion-t{t:g}"] = (lambda t: lambda ps, n: bc.run_mode(served, ps, SamplingParams.from_flat(
            **{**base, "max_tokens": n}, block_size=4, threshold=t, speculative=False)))(t)
    for k in quota_blocks:
        modes[f"diffusion-b{k}-quota"] = (lambda k: lambda ps, n: bc.run_mode(served, ps, SamplingParams.from_flat(
            **{**base, "max_tokens": n}, block_size=k, steps=max(1, n // k), speculative=False)))(k)
    for run in modes.values():  # warm-up (first-call allocations), not timed
        run(prompts[:1], 4)
    tg_prompts = prompts[: args.tg_prompts]
    tg_modes = {f"tg-{fmt}": (lambda llm: lambda: engine_tg(llm, tg_prompts, args.max_tokens, lambda k: (
        SamplingParams.from_flat(**{**base, "max_tokens": k}, block_size=1, speculative=False, ignore_eos=True))))(llm)
        for fmt, llm in block1.items()}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    tg_runs: dict[str, list[dict]] = {m: [] for m in tg_modes}
    for rep in range(args.repeats):
        for m, run in modes.items():
            runs[m].append(run(prompts, args.max_tokens))
            r = runs[m][-1]
            print(f"repeat {rep} {m}: {r['tokens']} tokens {r['seconds']:.2f} s", flush=True)
        for m, run in tg_modes.items():
            tg_runs[m].append(run())
            r = tg_runs[m][-1]
            print(f"repeat {rep} {m}: {r['tokens']} tokens {r['seconds']:.2f} s", flush=True)

    llama = None
    if Path(args.llama_bench).is_file():
        llama = llama_bench(args.llama_bench, str(smollm2_gguf_path()), args.max_tokens, args.threads,
                            max(args.repeats, 3))
    parent_ref = [o.token_ids for o in runs[f"block1-{served_fmt}"][0]["outs"]]
    hf_ref = [o.token_ids for o in runs["hf"][0]["outs"]]
    summary = {}
    for m, rs in runs.items():
        outs = rs[0]["outs"]
        summary[m] = {"tokens_per_s": bc.median([r["tokens"] / r["seconds"] for r in rs]),
                      "tpf": rs[0]["tokens"] / max(1, rs[0]["nfe"]), "tokens": rs[0]["tokens"],
                      "identical_to_parent": sum(o.token_ids == r for o, r in zip(outs, parent_ref)) / len(outs),
                      "identical_to_hf": sum(o.token_ids == r for o, r in zip(outs, hf_ref)) / len(outs),
                      "accuracy": accuracy(outs, prompts), "seconds": [round(r["seconds"], 3) for r in rs]}
    for m, rs in tg_runs.items():
        summary[m] = {"tokens_per_s": bc.median([r["tokens"] / r["seconds"] for r in rs]), "tpf": 1.0,
                      "tokens": rs[0]["tokens"], "identical_to_parent": None, "identical_to_hf": None,
                      "accuracy": None, "seconds": [round(r["seconds"], 3) for r in rs]}
    ref_tps = summary[f"block1-{served_fmt}"]["tokens_per_s"]
    judge(summary, served_fmt, llama["tokens_per_s"] if llama else None)

    memory = None
    if not args.no_memory:
        bodies = [{"messages": [{"role": "user", "content": p["prompt"]}], "max_tokens": args.max_tokens,
                   "temperature": 0} for p in prompts[: max(1, args.memory_requests - 1)]]
        bodies.append({**bodies[0], "block_size": 4, "threshold": thresholds[-1]})  # the diffusion (adapter) path
        with tempfile.TemporaryDirectory(prefix="bench_default_") as tmp:
            parent_mem = server_memory([parent_dir], bodies, args.threads, Path(tmp) / "parent.log")
            default_mem = server_memory([args.served] if args.served else [], bodies, args.threads,
                                        Path(tmp) / "default.log")
        memory = {"parent": parent_mem, "default": default_mem, "served": served_what,
                  **judge_memory(parent_mem, default_mem)}

    label = {f: f if f != "auto" else f"auto: {_layers(block1[f].model)}" for f in FORMATS}
    names = {"hf": "transformers greedy (parent, KV cache)", "spec": f"speculative, served default ({served_kind})",
             **{f"block1-{f}": f"engine block 1, {label[f]}" for f in FORMATS},
             **{f"tg-{f}": f"engine block 1 tg{args.max_tokens} (generation only), {label[f]}" for f in FORMATS},
             **{f"spec-b{b}-br{br}": f"speculative, block {b}, {br} branches ({served_kind})" for b, br in spec_configs},
             **{f"diffusion-t{t:g}": f"plain diffusion b4, threshold {t:g} ({served_kind})" for t in thresholds},
             **{f"diffusion-b{k}-quota": f"plain diffusion b{k}, one step per block ({served_kind})"
                for k in quota_blocks}}
    rows = [[names[m], s["tokens_per_s"], f"{s['x_block1']:.2f}x",
             f"{s['x_llama_cpp']:.2f}x" if s["x_llama_cpp"] is not None else "", s["tpf"],
             "" if s["identical_to_parent"] is None else f"{s['identical_to_parent']:.0%}",
             "" if s["accuracy"] is None else f"{s['accuracy']:.0%}", s.get("target", ""),
             verdict(s["pass"]) if "target" in s else ""] for m, s in summary.items()]
    if llama:
        rows.insert(1, [f"llama.cpp llama-bench tg{args.max_tokens} (same GGUF)", llama["tokens_per_s"],
                        f"{llama['tokens_per_s'] / ref_tps:.2f}x", "1.00x", 1.0, "", "", "", ""])
    else:
        rows.insert(1, ["llama.cpp llama-bench", "not measured", "", "", "", "", "", "",
                        f"no binary at {args.llama_bench} (run benchmarks/build_llama_bench.sh)"])
    md = (f"{len(prompts)} held-out grid prompts ({sum(p.get('answer') is not None for p in prompts)} checkable), "
          f"max {args.max_tokens} new tokens, greedy, stop at EOS, batch 1, {args.threads} thread(s), "
          f"{args.repeats} repeats (tokens/s: median over repeats of the set's tokens / seconds; the 'tg' rows: "
          f"{len(tg_prompts)} prompts, {args.max_tokens} tokens each after the prompt's forward, EOS ignored, "
          f"prefill not counted, as llama-bench's tg; the block-1 target is judged there). Parent "
          f"{parent_dir}; served default: {served_what}; ratios against the engine block 1 in the served weight "
          f"format ({served_kind}); 'identical' = answers equal to that block 1's (the served parent).\n\n"
          + bc.markdown_table(["decoder", "tokens/s", "x block 1", "x llama.cpp", "TPF", "identical to parent",
                               "answer accuracy", "target (issue 25)", "result"], rows))
    if memory:
        p, d = memory["parent"], memory["default"]
        md += (f"\nServer memory (MB = 10^6 bytes; each server got the same {len(bodies)} requests):\n\n"
               + bc.markdown_table(["server", "RSS loaded", "RSS after requests", "peak RSS (VmHWM)", "target",
                                    "result"],
                                   [["unmask serve PARENT (parent alone)", p["rss_loaded_mb"], p["rss_after_mb"],
                                     p["peak_rss_mb"], "", ""],
                                    [f"unmask serve {args.served or ''} (parent + adapter)", d["rss_loaded_mb"], d["rss_after_mb"],
                                     d["peak_rss_mb"], f"peak < {TARGETS['default_peak_rss_mb']:.0f} MB",
                                     verdict(memory["default_peak_pass"])],
                                    ["adapter's extra RSS", "", memory["adapter_extra_rss_mb"],
                                     memory["adapter_extra_peak_mb"], f"<= {TARGETS['adapter_extra_rss_mb']:.0f} MB",
                                     verdict(memory["adapter_extra_pass"])]]))
    data = {"benchmark": "default", "settings": {**vars(args), "parent": parent_dir, "served": served_what,
                                                 "served_path": served_path, "served_weights": served_kind,
                                                 "prompt_ids": [p["id"] for p in prompts]},
            "targets": TARGETS, "environment": env, "summary": summary, "llama_cpp": llama, "memory": memory,
            "adapter": served.model.adapter,
            "samples": {m: [o.text for o in rs[0]["outs"]] for m, rs in runs.items()}}

    def plot(path):
        import matplotlib.pyplot as plt

        speed = [(r[0], r[1]) for r in rows if isinstance(r[1], float)]
        fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(11 if memory else 7, 4), squeeze=False)
        ax = axes[0][0]
        ax.barh([n for n, _ in speed][::-1], [v for _, v in speed][::-1])
        ax.axvline(ref_tps, color="grey", ls="--", lw=1, label=f"engine block 1 ({served_kind})")
        ax.set_xlabel("tokens/s (batch 1)")
        ax.legend(loc="lower right", fontsize=8)
        if memory:
            ax = axes[0][1]
            servers = [memory["parent"], memory["default"]]
            for k, (key, label) in enumerate([("rss_loaded_mb", "RSS loaded"), ("rss_after_mb", "RSS after requests"),
                                              ("peak_rss_mb", "peak RSS")]):
                ax.bar([i + (k - 1) * 0.27 for i in range(2)], [m[key] for m in servers], width=0.27, label=label)
            ax.set_xticks([0, 1], ["parent alone", "parent + adapter (default)"])
            ax.axhline(TARGETS["default_peak_rss_mb"], color="red", ls="--", lw=1, label="peak target")
            ax.set_ylabel("MB")
            ax.legend(fontsize=8)
        bc.save_figure(fig, path)

    return bc.report(args.out_name, data, md, plot)


if __name__ == "__main__":
    raise SystemExit(main())
