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
``LLM`` on the GGUF (``weights auto``: fbgemm fp16 for both files), ``cache=none`` (the same algorithm: the whole
canvas forwarded every step) and ``cache=dual`` (Fast-dLLM's dual cache, the best cache for a bidirectional
model; approximate), generation time of ``LLM.generate`` after a warm-up. Medians over ``--repeats`` runs,
interleaved; CPU seconds (user + system, all threads) beside the wall seconds, since on a shared machine the wall
time is partly the scheduler's. Results are written after every configuration, so a cut run keeps what it
measured.

    TARGET=llama-diffusion-cli benchmarks/build_llama_bench.sh     # once: ~/.cache/unmask/llama.cpp/bin/
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


def run_llama(binary: Path, gguf: Path, steps: int, threads: int) -> dict:
    """One ``llama-diffusion-cli`` run; its ``total time`` (ms) and forwards."""
    ub = PROMPT_TOKENS + GEN
    blocks = ub // BLOCK
    per_block = steps // (GEN // BLOCK)
    cmd = [str(binary), "-m", str(gguf), "-p", PROMPT, "-ub", str(ub), "-b", str(ub), "-c", "4096",
           "--diffusion-block-length", str(BLOCK), "--diffusion-steps", str(per_block * blocks),
           "--temp", "0", "--top-k", "1", "-t", str(threads), "-tb", str(threads), "--seed", "0"]
    before = os.times()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    m = re.search(r"total time: ([0-9.]+)ms, time per step: ([0-9.]+)ms, sampling time per step: ([0-9.]+)ms",
                  r.stdout + r.stderr)
    if r.returncode or not m:  # recorded, not raised: unmask's own timings of the file still count
        import signal

        why = signal.Signals(-r.returncode).name if r.returncode < 0 else f"exit {r.returncode}"
        return {"seconds": float("nan"), "forwards": 0, "failed": why, "tail": (r.stdout + r.stderr)[-300:]}
    forwards = per_block * (GEN // BLOCK) + (blocks - GEN // BLOCK)  # an empty block past the canvas: one forward
    total_s = float(m.group(1)) / 1e3
    sampling_s = float(m.group(3)) * per_block * blocks / 1e3
    return {"seconds": total_s, "forwards": forwards, "sampling_seconds": sampling_s, "cpu_seconds_with_load": cpu,
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "unmask" / "bench_gguf"))
    ap.add_argument("--llama-diffusion-cli", default=str(LLAMA_DIR / "bin" / "llama-diffusion-cli"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="f16,q8_0")
    ap.add_argument("--steps", default="32,128")
    args = ap.parse_args(argv)
    bc.set_threads(args.threads)
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import load_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    hf = make_checkpoint(work / "llada-0.5b")
    env = bc.environment(args.threads)
    binary = Path(args.llama_diffusion_cli)
    rows, results = [], {}
    for fmt in args.formats.split(","):
        gguf = convert(hf, fmt, work / f"llada-0.5b-{fmt}.gguf")
        lm = load_model(gguf, device="cpu", dtype="float32", weights="auto")
        ids = unmask_prompt(lm)
        if len(ids) != PROMPT_TOKENS:
            raise SystemExit(f"the prompt is {len(ids)} tokens, the block arithmetic needs {PROMPT_TOKENS}")
        llm = LLM(lm)
        for cache in ("none", "dual"):  # warm-up: one block of 4 steps
            llm.generate([ids], SamplingParams(max_tokens=BLOCK, block_size=BLOCK, steps=4, temperature=0.0,
                                               ignore_eos=True, cache=cache))
        for steps in (int(s) for s in args.steps.split(",")):
            runs = {"llama.cpp": [], "none": [], "dual": []}
            for _ in range(args.repeats):
                runs["llama.cpp"].append(run_llama(binary, gguf, steps, args.threads))
                for cache in ("none", "dual"):
                    runs[cache].append(run_unmask(llm, ids, steps, cache))
            med = {k: bc.median([r["seconds"] for r in v]) for k, v in runs.items()}
            key = f"{fmt}-steps{steps}"
            fwd = {k: v[0]["forwards"] or float("nan") for k, v in runs.items()}
            results[key] = {"runs": runs, "median_seconds": med, "weights": lm.weight_format,
                            "packed_layers": dict(lm.packed_layers or {}),
                            "speedup": {c: med["llama.cpp"] / med[c] for c in ("none", "dual")},
                            "speedup_per_forward": {c: (med["llama.cpp"] / fwd["llama.cpp"]) / (med[c] / fwd[c])
                                                    for c in ("none", "dual")}}
            for c in ("none", "dual"):
                s = results[key]["speedup"][c]
                failed = runs["llama.cpp"][0].get("failed")
                rows.append([fmt.upper(), steps, c, f"failed ({failed})" if failed else med["llama.cpp"],
                             fwd["llama.cpp"], med[c], fwd[c], s, results[key]["speedup_per_forward"][c], TARGETS[c],
                             "no baseline" if failed else "pass" if s >= TARGETS[c] else "MISS"])
            print(json.dumps({key: results[key]["median_seconds"]}), flush=True)
            write(args, env, rows, results)
        del llm, lm
    return 0


def write(args, env: dict, rows: list, results: dict) -> None:
    """The result files with what was measured so far."""
    md = bc.markdown_table(["GGUF", "steps", "unmask cache", "llama.cpp s", "llama.cpp fwd", "unmask s", "unmask fwd",
                            "speed-up", "per forward", "target", ""], rows)
    md += ("\n\nGeneration 128 tokens, block 32, greedy, 2 threads, prompt 64 tokens; seconds = medians of "
           f"{args.repeats} run(s) (generation loop only). llama.cpp's two extra forwards are its empty blocks past "
           "the canvas (module docstring); 'per forward' compares seconds per forward.\n")
    data = {"environment": env, "settings": {"gen": GEN, "block": BLOCK, "prompt_tokens": PROMPT_TOKENS,
                                             "threads": args.threads, "repeats": args.repeats, "shape": SHAPE},
            "results": results, "targets": TARGETS}
    bc.write_results("bench_gguf_vs_llama", data, md)
    print(md, flush=True)


if __name__ == "__main__":
    bc.run_script(main)
