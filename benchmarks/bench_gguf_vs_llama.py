"""unmask on a LLaDA GGUF vs llama.cpp's ``llama-diffusion-cli`` on the same file (issue 45).

The model: a random LLaDA-architecture checkpoint of ~0.48B parameters (d_model 1024, 28 layers, 16 heads, MLP 3072,
SmolLM2's tokenizer with ``<|mdm_mask|>`` added: 49,216 rows), written in LLaDA's own layout
(``tests/tiny.py: llada_replica_state_dict``, decisive head) and converted by llama.cpp's own converter
(``convert_hf_to_gguf.py`` of the llama-cpp-python sdist, ``--outtype f16`` and ``--outtype q8_0``). Both programs
read the same file.

Settings, the same on both sides: the chat-formatted prompt (SmolLM2's template with its default system prompt, 64
tokens with BOS), generation length 128, block 32, 128 and 32 denoising steps (1 and 4 tokens a step), greedy, 2
threads.
``llama-diffusion-cli``: ``--diffusion-block-length 32 --top-k 1 --temp 0`` (greedy: with ``--temp 0`` alone it
samples from the softmax; ``--top-k 1`` makes its confidences all 1, so it reveals left to right, which changes
no cost), ``-ub 192`` (its canvas is prompt + generation, and it counts blocks from position 0 of the canvas: 192 / 32
= 6 blocks, the last two empty, so ``--diffusion-steps`` is 192 / 48 and it runs 130 / 34 forwards: two more than
unmask's 128 / 32, reported; the per-forward ratio is reported too). Its time is its own ``total time`` line (the
generation loop, load excluded). unmask:
``LLM`` on the GGUF in two compute dtypes (``--dtypes``): float32 with ``weights auto`` (fbgemm fp16 for both
files: the F16 values as they are, Q8_0's ``d * q`` rounded to fp16) and bfloat16 with ``weights native``
(oneDNN's bf16 GEMM, AMX where the CPU has it; weights rounded to bf16, the CPU bf16 contract). Per dtype
``cache=none`` (the same algorithm: the whole canvas forwarded every step) and ``cache=dual`` (Fast-dLLM's dual
cache, the best cache for a bidirectional model; approximate), generation time of ``LLM.generate`` after a
warm-up. Medians over ``--repeats`` runs, interleaved; CPU seconds (user + system, all threads; llama.cpp's from
its first progress line on) beside the wall seconds, since on a shared machine the wall time is partly the
scheduler's (with 2 busy threads on an oversubscribed machine every parallel region waits for a descheduled
thread, which costs torch's many small ops per forward more than llama.cpp's graph). All models are loaded first
and the step counts run outer, so a run cut during 128 steps keeps every format at 32. Results are
written after every configuration, so a cut run keeps what it measured.

llama.cpp binary: ``llama-diffusion-cli-noamx`` when built (``AMX=0``), else the native one: on the VM measured
ggml's AMX Q8_0 kernel dies with SIGILL (``tileloadd``) although the kernel grants AMX (oneDNN's AMX kernels run in
the same VM); without AMX its Q8_0 matmuls take the AVX512-VNNI path; F16 takes the same path in both builds.

    TARGET=llama-diffusion-cli AMX=0 benchmarks/build_llama_bench.sh     # once: ~/.cache/unmask/llama.cpp/bin/
    .venv/bin/python benchmarks/bench_gguf_vs_llama.py
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import bench_common as bc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

LLAMA_DIR = Path.home() / ".cache" / "unmask" / "llama.cpp"
PROMPT = ("Explain in two short paragraphs why the sky looks blue during the day, and why sunsets over the sea look red "
          "and orange instead, using the physics of light.")
GEN, BLOCK, PROMPT_TOKENS = 128, 32, 64
SHAPE = {"d_model": 1024, "n_layers": 28, "n_heads": 16, "n_kv_heads": 16, "mlp_hidden_size": 3072}
TARGETS = {"none": 1.5, "dual": 4.0}  # issue 45: unmask / llama.cpp
#: unmask's compute dtypes and the weight format each runs with: float32 activations with fbgemm's fp16 weights (the
#: CPU default, the file's F16 values as they are), or bfloat16 weights and activations (``--dtype bfloat16``: oneDNN's
#: bf16 GEMM, AMX where the CPU has it; weights rounded from F16 to bf16: the CPU bf16 column of
#: docs/design.md#exactness-contracts-by-device-and-dtype)
DTYPES = {"float32": "auto", "bfloat16": "native"}


def llama_source() -> Path:
    """The vendored llama.cpp of the newest llama-cpp-python sdist unpacked by build_llama_bench.sh."""
    tops = sorted((LLAMA_DIR / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not tops:
        raise SystemExit(f"no llama.cpp sources under {LLAMA_DIR / 'src'}: run TARGET=llama-diffusion-cli "
                         "benchmarks/build_llama_bench.sh")
    return tops[-1]


def make_checkpoint(out: Path, seed: int = 0) -> Path:
    """The random LLaDA directory (module docstring); reused when present."""
    if (out / "config.json").is_file():
        return out
    import torch
    from tiny import llada_config_dict, llada_replica_state_dict, save_foreign_checkpoint
    from transformers import AutoTokenizer

    from unmask.training.realmodel import smollm2_gguf_path

    g = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    tok.add_special_tokens({"additional_special_tokens": ["<|mdm_mask|>"]}, replace_extra_special_tokens=False)
    rows = -(-len(tok) // 64) * 64
    cfg = llada_config_dict(rows, eos_token_id=tok.eos_token_id, mask_token_id=tok.convert_tokens_to_ids("<|mdm_mask|>"),
                            max_sequence_length=4096, **SHAPE)
    state = llada_replica_state_dict(cfg, seed)
    state = {k: v.to(torch.float16) for k, v in state.items()}
    save_foreign_checkpoint(out, state, cfg, tok)
    return out


def convert(hf: Path, outtype: str, out: Path) -> Path:
    """``convert_hf_to_gguf.py HF --outtype OUTTYPE`` (llama.cpp's converter, its own gguf-py); reused when present."""
    if out.is_file():
        return out
    src = llama_source()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(out),
                    "--outtype", outtype], check=True, env=env, capture_output=True)
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _watch_until_loop(proc) -> tuple[float, bytes]:
    """Read ``proc``'s stderr until its first ``diffusion step:`` progress line (the generation loop starts); the
    process's CPU seconds then (loading and warm-up), and what was read."""
    seen = b""
    while b"diffusion step:" not in seen:
        chunk = os.read(proc.stderr.fileno(), 65536)
        if not chunk:
            return float("nan"), seen
        seen += chunk
    return _cpu_seconds(proc.pid), seen


def run_llama(binary: Path, gguf: Path, steps: int, threads: int, passive: bool = False) -> dict:
    """One ``llama-diffusion-cli`` run; its ``total time`` (ms), forwards, and CPU seconds of its generation loop
    (the whole process's minus those spent before its first progress line)."""
    import threading

    ub = PROMPT_TOKENS + GEN
    blocks = ub // BLOCK
    per_block = steps // (GEN // BLOCK)
    cmd = [str(binary), "-m", str(gguf), "-p", PROMPT, "-ub", str(ub), "-b", str(ub), "-c", "4096",
           "--diffusion-block-length", str(BLOCK), "--diffusion-steps", str(per_block * blocks),
           "--temp", "0", "--top-k", "1", "-t", str(threads), "-tb", str(threads), "--seed", "0"]
    cmd += ["--poll", "0"] if passive else []
    before = os.times()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    cpu_before_loop, head = _watch_until_loop(proc)
    tail = proc.stderr.read()
    proc.wait(timeout=3600)
    reader.join()
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    text = (b"".join(out) + head + tail).decode(errors="replace")
    m = re.search(r"total time: ([0-9.]+)ms, time per step: ([0-9.]+)ms, sampling time per step: ([0-9.]+)ms", text)
    if proc.returncode or not m:  # recorded, not raised: unmask's own timings of the file still count
        import signal

        why = signal.Signals(-proc.returncode).name if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"seconds": float("nan"), "cpu_seconds": float("nan"), "forwards": 0, "failed": why,
                "tail": text[-300:]}
    forwards = per_block * (GEN // BLOCK) + (blocks - GEN // BLOCK)  # an empty block past the canvas: one forward
    total_s = float(m.group(1)) / 1e3
    sampling_s = float(m.group(3)) * per_block * blocks / 1e3
    return {"seconds": total_s, "forwards": forwards, "sampling_seconds": sampling_s,
            "cpu_seconds": cpu - cpu_before_loop, "cpu_seconds_with_load": cpu,
            "command": " ".join(cmd[:1] + [Path(cmd[2]).name if i == 2 else c for i, c in enumerate(cmd[1:], 1)])}


def unmask_prompt(lm) -> list[int]:
    """The prompt ids llama-diffusion-cli decodes: the chat template rendered with the generation prompt, tokenized
    with the GGUF's BOS (``common_tokenize(..., add_special=true, parse_special=true)``)."""
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                            add_generation_prompt=True)
    return lm.tokenizer(text).input_ids


def run_unmask(llm, ids: list[int], steps: int, cache: str) -> dict:
    from unmask.engine import SamplingParams

    sp = SamplingParams(max_tokens=GEN, block_size=BLOCK, steps=steps, temperature=0.0, ignore_eos=True, cache=cache)
    t, c = time.perf_counter(), time.process_time()
    out = llm.generate([ids], sp)[0].outputs[0]
    return {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c, "forwards": out.steps,
            "tokens": len(out.token_ids)}


def default_binary() -> Path:
    """``llama-diffusion-cli-noamx`` when built (``AMX=0``, build_llama_bench.sh), else ``llama-diffusion-cli``: the
    native build's Q8_0 matmuls die with SIGILL in ggml's AMX kernel on the VM measured (its F16 matmuls do not use
    AMX, so the two builds run F16 through the same code)."""
    noamx = LLAMA_DIR / "bin" / "llama-diffusion-cli-noamx"
    return noamx if noamx.is_file() else LLAMA_DIR / "bin" / "llama-diffusion-cli"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "unmask" / "bench_gguf"))
    ap.add_argument("--llama-diffusion-cli", default=str(default_binary()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="f16,q8_0")
    ap.add_argument("--steps", default="32,128")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="unmask's compute dtypes: float32 (weights auto: fbgemm fp16), bfloat16 (weights native)")
    ap.add_argument("--passive", action="store_true",
                    help="threads wait passively on both sides: OMP_WAIT_POLICY=PASSIVE for unmask (libgomp), "
                         "--poll 0 for llama.cpp; the result keys end in -passive")
    ap.add_argument("--merge", action="store_true",
                    help="keep the configurations of the existing result file that this run does not measure")
    args = ap.parse_args(argv)
    if args.passive and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":  # read when libgomp loads
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    bc.set_threads(args.threads)
    from unmask.engine.model import load_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(work / "llada-0.5b")
    env = bc.environment(args.threads)
    env["llama_diffusion_cli"] = Path(args.llama_diffusion_cli).name
    binary = Path(args.llama_diffusion_cli)
    models = {}
    for fmt in args.formats.split(","):  # all loaded up front: a cut run keeps every format at the first steps
        gguf = convert(hf, fmt, work / f"llada-0.5b-{fmt}.gguf")
        models[fmt] = (gguf, {d: load_model(gguf, device="cpu", dtype=d, weights=DTYPES[d])
                              for d in args.dtypes.split(",")})
    results = previous_results() if args.merge else {}
    for steps in (int(s) for s in args.steps.split(",")):
        for fmt, (gguf, lms) in models.items():
            key = f"{fmt}-steps{steps}" + ("-passive" if args.passive else "")
            results[key] = measure(binary, gguf, lms, steps, args)
            print(json.dumps({key: results[key]["median_seconds"]}), flush=True)
            write(args, env, results)
    return 0


def previous_results() -> dict:
    """The configurations of the committed result file (``--merge``), or none."""
    path = bc.RESULTS / "bench_gguf_vs_llama.json"
    return json.loads(path.read_text())["results"] if path.is_file() else {}


def measure(binary: Path, gguf: Path, lms: dict, steps: int, args) -> dict:
    """``--repeats`` interleaved runs of llama.cpp and, per unmask dtype (``lms``: dtype -> loaded model), unmask
    without cache and with the dual cache (after one warm-up block per cache); medians of wall and CPU seconds, the
    speed-ups and the load average at each run. Configurations: ``none`` / ``dual`` (float32), ``none bf16`` /
    ``dual bf16``."""
    from unmask.engine import LLM, SamplingParams

    llms = {}
    for dtype, lm in lms.items():
        ids = unmask_prompt(lm)
        if len(ids) != PROMPT_TOKENS:
            raise SystemExit(f"the prompt is {len(ids)} tokens, the block arithmetic needs {PROMPT_TOKENS}")
        llm = LLM(lm)
        for cache in ("none", "dual"):  # warm-up: one block of 4 steps
            llm.generate([ids], SamplingParams(max_tokens=BLOCK, block_size=BLOCK, steps=4, temperature=0.0,
                                               ignore_eos=True, cache=cache))
        llms[dtype] = (llm, ids)
    suffix = {"float32": "", "bfloat16": " bf16"}
    runs = {"llama.cpp": []} | {c + suffix[d]: [] for d in llms for c in ("none", "dual")}
    for _ in range(args.repeats):
        llama = run_llama(binary, gguf, steps, args.threads, args.passive)
        runs["llama.cpp"].append(dict(llama, load=os.getloadavg()[0]))
        for dtype, (llm, ids) in llms.items():
            for cache in ("none", "dual"):
                runs[cache + suffix[dtype]].append(dict(run_unmask(llm, ids, steps, cache), load=os.getloadavg()[0]))
    med = {k: bc.median([r["seconds"] for r in v]) for k, v in runs.items()}
    cpu = {k: bc.median([r["cpu_seconds"] for r in v]) for k, v in runs.items()}
    fwd = {k: v[0]["forwards"] or float("nan") for k, v in runs.items()}
    ours = [k for k in runs if k != "llama.cpp"]
    return {"runs": runs, "median_seconds": med, "median_cpu_seconds": cpu,
            "weights": {d: lm.weight_format for d, lm in lms.items()},
            "packed_layers": {d: dict(lm.packed_layers or {}) for d, lm in lms.items()},
            "speedup": {c: med["llama.cpp"] / med[c] for c in ours},
            "speedup_cpu_seconds": {c: cpu["llama.cpp"] / cpu[c] for c in ours},
            "speedup_per_forward": {c: (med["llama.cpp"] / fwd["llama.cpp"]) / (med[c] / fwd[c]) for c in ours},
            "threads_wait": "passive" if args.passive else "default (spin, then sleep)",
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "binary": binary.name,
            "load_range": [min(r["load"] for v in runs.values() for r in v),
                           max(r["load"] for v in runs.values() for r in v)]}


def table_rows(key: str, res: dict) -> list[list]:
    """The Markdown rows of one result (``f16-steps32``, ``f16-steps32-passive``): one per unmask configuration."""
    fmt, steps = key.split("-steps")
    steps, wait = (steps.split("-") + [""])[:2]
    med, cpu, runs = res["median_seconds"], res["median_cpu_seconds"], res["runs"]
    failed = runs["llama.cpp"][0].get("failed")
    rows = []
    for c in res["speedup"]:
        s, target = res["speedup"][c], TARGETS[c.split()[0]]
        rows.append([fmt.upper(), int(steps), c + (f" ({wait})" if wait else ""), f"failed ({failed})" if failed else med["llama.cpp"],
                     cpu["llama.cpp"], runs["llama.cpp"][0]["forwards"] or float("nan"), med[c], cpu[c],
                     runs[c][0]["forwards"], s, res["speedup_cpu_seconds"][c], res["speedup_per_forward"][c], target,
                     "no baseline" if failed else "pass" if s >= target else "MISS",
                     "{:.1f}-{:.1f}".format(*res["load_range"]), len(runs["llama.cpp"])])
    return rows


def write(args, env: dict, results: dict) -> None:
    """The result files with what was measured so far (and, with ``--merge``, kept from the previous file)."""
    rows = [row for key in sorted(results, key=lambda k: (int(k.split("steps")[1].split("-")[0]), k)) for row in
            table_rows(key, results[key])]
    md = bc.markdown_table(["GGUF", "steps", "unmask cache", "llama.cpp s", "llama.cpp CPU s", "llama.cpp fwd",
                            "unmask s", "unmask CPU s", "unmask fwd", "speed-up", "CPU-s ratio", "per forward",
                            "target", "", "load", "runs"], rows)
    md += ("\n\nGeneration 128 tokens, block 32, greedy, 2 threads, prompt 64 tokens; seconds = medians of "
           "'runs' interleaved runs (generation loop only); 'bf16' = unmask in bfloat16 (weights rounded from the "
           "file's values to bf16), else float32 activations with fbgemm fp16 weights. llama.cpp's two extra "
           "forwards are its empty blocks past the canvas (module docstring); 'per forward' compares seconds per "
           "forward; 'CPU-s ratio' compares CPU seconds (user + system, both threads); load = the 1-minute load "
           f"average at the runs. llama.cpp: `{env.get('llama_diffusion_cli')}`. With --merge the rows of other "
           "runs keep their own 'utc', 'binary' and 'load_range' (the JSON).\n")
    data = {"environment": env, "settings": {"gen": GEN, "block": BLOCK, "prompt_tokens": PROMPT_TOKENS,
                                             "threads": args.threads, "repeats": args.repeats, "shape": SHAPE},
            "results": results, "targets": TARGETS}
    bc.write_results("bench_gguf_vs_llama", data, md)
    print(md, flush=True)


if __name__ == "__main__":
    bc.run_script(main)
