"""The GPU check: what a first hour on an NVIDIA GPU should tell us, in at most 5 minutes, with everything built in
memory from random weights and nothing downloaded (docs/gpu.md).

1. **environment**: driver (nvidia-smi), torch and its CUDA build, cuDNN, the GPU's name, memory and capability,
   the SDPA backends (enabled flags, and a probe of each with and without a boolean mask).
2. **cuda lane**: tests/cuda_lane.py's checks called directly (no pytest): every decoding path of
   tests/decoding_paths.py in float32 and bfloat16 against the CPU float32 reference, and the engine's exactness
   contracts on the device.
3. **host syncs per request-step**: a few batches decoded under ``torch.cuda.set_sync_debug_mode("warn")``; the
   synchronising calls counted per request and step (reported, not judged).
4. **speed**: an LLaDA-8B-shaped random bfloat16 model (hidden 4096, 32 layers, 32 heads, MLP 12288, vocab 126464,
   mask id 126336; built on the device through the llada family's config mapping) at batch 1, 8 and 32, prompt
   256, 64 new tokens, block 32, one token per step (64 steps), the engine with cache ``none`` and ``dual``,
   against :func:`reference_generate`, a plain PyTorch loop of LLaDA's published ``generate()`` algorithm on the
   same weights. Tokens must be equal where the algorithm is the same (cache none vs the reference) in float32: a
   small LLaDA-shaped float32 model checks that on the device (``reference_equality``); in bfloat16 the match
   fraction is reported (see :func:`speed`).
5. **cuda graphs** (``--cuda-graphs``, engine/step_graphs.py): the batched reveal pass captured as a CUDA graph per
   bucket and replayed, against the eager pass on the same inputs: tokens and reveals equal, probabilities within
   1e-9 (required; bit for bit on a CPU, reported), and the median time of both per step at 32, 256 and 1,024 rows (batch 1, 8, 32 x block 32) over
   the LLaDA-8B vocabulary; then the cuda lane's causal checkpoint decodes a sampled batch with and without
   ``cuda_graphs`` (equal tokens required). With ``--device cpu`` the same code runs the static step uncaptured
   (equality only) and checks that ``cuda_graphs`` is refused on a CPU.

Runs where only torch and transformers are installed and unmask is not (it registers this checkout as the
``unmask`` package: :func:`use_source_tree`)::

    python benchmarks/gpu_check.py                        # on a GPU: JSON to benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --device cpu --small   # the same code paths on a small model (CI)
    python benchmarks/gpu_check.py --check-env-only       # section 1 only, seconds
    python benchmarks/gpu_check.py --skip-lane --skip-speed --out /tmp/graphs.json   # sections 1, 3, 5

Exit status 0 when every required check passed, 1 otherwise (the JSON says which), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"

# LLaDA-8B (GSAI-ML/LLaDA-8B-Instruct config.json) and a small model of the same layout
LLADA_8B = dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288, vocab=126464,
                mask_id=126336, eos_id=126081, eot_id=126348)
SMALL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128, vocab=1024,
             mask_id=1024 - 128, eos_id=1024 - 383, eot_id=1024 - 116)
FULL_RUN = dict(batches=(1, 8, 32), prompt=256, new_tokens=64, block=32)
SMALL_RUN = dict(batches=(1, 4), prompt=32, new_tokens=16, block=8)


def use_source_tree() -> str:
    """Make ``import unmask.engine`` load this checkout's ``engine/`` (pyproject maps ``unmask.X`` to folder ``X``):
    kept when an installed ``unmask`` already points here, else ``unmask`` is registered as a namespace package
    over the checkout's root. Returns which."""
    try:
        import unmask.engine as engine

        if Path(engine.__file__).resolve().parent == ROOT / "engine":
            return "installed package (this checkout)"
    except ImportError:  # not installed (the GPU host), or installed without its dependencies
        pass
    for name in [n for n in sys.modules if n == "unmask" or n.startswith("unmask.")]:
        del sys.modules[name]
    pkg = types.ModuleType("unmask")
    pkg.__path__ = [str(ROOT)]
    sys.modules["unmask"] = pkg
    return "source tree (unmask registered over the checkout)"


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:800]


# ------------------------------------------------------------------ 1. environment
def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def sdpa_probe(device: str) -> dict:
    """Which SDPA backend runs a bf16 (CUDA) / float32 (CPU) call ``[2, 8, 128, 64]``, without a mask and with a
    boolean mask (the engine always passes one): ``{backend: {"no_mask": "ok" | error, "bool_mask": ...}}``."""
    import torch
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:  # torch < 2.3
        return {"error": error_text(exc)}
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 8, 128, 64, device=device, dtype=dt, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 128, 128, device=device, dtype=torch.bool).tril()
    out = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            out[name.lower()] = "not in this torch"
            continue
        row = {}
        for label, m in (("no_mask", None), ("bool_mask", mask)):
            with warnings.catch_warnings(record=True) as why:  # a backend that declines says why in a warning
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                    row[label] = "ok"
                except Exception as exc:  # noqa: BLE001 - "not available" is the answer
                    reasons = [str(w.message).splitlines()[0] for w in why] or [error_text(exc).splitlines()[0]]
                    row[label] = "; ".join(reasons)[:300]
        out[name.lower()] = row
    return out


def environment(device: str) -> dict:
    """Section 1: the machine, the driver, torch/CUDA/cuDNN, the GPU and the SDPA backends."""
    import torch
    import transformers

    import cuda_lane

    env = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": sys.version.split()[0],
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "torch_cuda_build": torch.version.cuda, "transformers": transformers.__version__,
           "cuda_available": torch.cuda.is_available(), "device": device,
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "git_commit": _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
           "llguidance": cuda_lane.has_llguidance()}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"])
    env["nvidia_smi"] = smi.splitlines() if smi else None
    env["driver_version"] = smi.splitlines()[0].split(",")[1].strip() if smi else None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpu_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                   bf16_supported=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version())
        flags = {}
        for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled",
                     "is_flash_attention_available"):
            fn = getattr(torch.backends.cuda, name, None)
            flags[name] = fn() if fn else None
        env["sdpa_flags"] = flags
    env["sdpa_probe"] = sdpa_probe("cuda" if torch.cuda.is_available() and device == "cuda" else "cpu")
    return env


# ------------------------------------------------------------------ 2. the cuda lane
def lane_section(device: str, lane) -> dict:
    """Section 2: tests/cuda_lane.py's checks on ``device`` (float32 and bfloat16 on CUDA; float32 on a CPU)."""
    import torch

    import cuda_lane

    dtypes = [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]
    out = {"rules": {"float32": cuda_lane.requirement(torch.float32),
                     "bfloat16": cuda_lane.requirement(torch.bfloat16),
                     "half_min_argmax": cuda_lane.HALF_MIN_ARGMAX,
                     "fp32_logit_tolerance": cuda_lane.FP32_LOGIT_TOLERANCE}}
    for dt in dtypes:
        t0 = time.perf_counter()
        checks = cuda_lane.run_lane(device, dt, lane)
        name = cuda_lane.dtype_name(dt)
        out[name] = {"summary": cuda_lane.summary(checks), "seconds": round(time.perf_counter() - t0, 2),
                     "checks": [c.as_dict() for c in checks]}
        s = out[name]["summary"]
        log(f"lane {device}/{name}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped")
    return out


# ------------------------------------------------------------------ 3. host syncs
SYNC_CASES = {  # name: (checkpoint, SamplingParams fields)
    "quota-exact-cache": ("causal", dict(temperature=0, speculative=False, block_size=4)),
    "bidirectional-cache-none": ("bidirectional", dict(temperature=0, block_size=4, cache="none")),
    "speculative-greedy": ("causal", dict(temperature=0, speculative=True, block_size=4)),
}


def count_syncs(llm, prompts: list, params) -> tuple[int, int]:
    """``(synchronising CUDA calls, request-steps)`` of one ``llm.generate(prompts, params)`` under
    ``torch.cuda.set_sync_debug_mode("warn")`` (each such call warns once)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outs = llm.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs, sum(o.outputs[0].steps for o in outs)


def syncs_section(device: str, lane, batch: int = 4) -> dict:
    """Section 3: host syncs per request-step of a few batches of ``batch`` requests (bfloat16; CUDA only)."""
    import torch
    from unmask.engine import SamplingParams

    import decoding_paths

    if device != "cuda":
        return {"skipped": "sync debug mode is CUDA's"}
    prompts = [decoding_paths.PROMPTS[i % len(decoding_paths.PROMPTS)] for i in range(batch)]
    out = {"batch": batch, "max_tokens": 16, "cases": {}}
    for name, (ckpt, fields) in SYNC_CASES.items():
        params = SamplingParams.from_flat(max_tokens=16, ignore_eos=True, **fields)
        try:
            llm = lane.llm(ckpt, "cuda", torch.bfloat16, enable_prefix_caching=False)
            llm.generate(prompts, params)  # warm-up: first-call syncs are not per step
            syncs, request_steps = count_syncs(llm, prompts, params)
            out["cases"][name] = {"syncs": syncs, "request_steps": request_steps,
                                  "syncs_per_request_step": round(syncs / max(1, request_steps), 2)}
        except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported
            out["cases"][name] = {"error": error_text(exc)}
    return out


# ------------------------------------------------------------------ 4. speed: engine vs the LLaDA reference loop
def word_tokenizer(spec: dict):
    """A word-level tokenizer over every id of ``spec``'s vocabulary (``t<id>``; LLaDA's special tokens at their
    ids), built in memory: the engine detokenises what it reveals."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {spec["mask_id"]: "<|mdm_mask|>", spec["eos_id"]: "<|endoftext|>", spec["eot_id"]: "<|eot_id|>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(spec["vocab"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|mdm_mask|>", additional_special_tokens=["<|eot_id|>"])


def build_llada(spec: dict, device: str, dtype, seed: int = 0, head_scale: float = 8.0, qk_scale: float = 3.0):
    """A :class:`~unmask.engine.model.LoadedModel` of LLaDA's layout at ``spec``'s sizes, built on ``device`` in
    ``dtype`` (no CPU copy): the llada family's config mapping (``llama_config_from_llada``) of a LLaDA
    ``config.json``, random weights from one device generator: linear ``N(0, 1/fan_in)`` (q/k ``qk_scale^2 /
    fan_in``: position-dependent attention), embeddings ``N(0, 1)``, norms 1, head ``N(0, head_scale^2 / d)``
    (decisive argmax), the mask token's head row zero (LLaDA never predicts its mask)."""
    import torch
    from transformers import LlamaForCausalLM
    from unmask.engine.config import DllmConfig
    from unmask.engine.families.llada import llama_config_from_llada
    from unmask.engine.model import LoadedModel

    import tiny

    cfg = tiny.llada_config_dict(spec["vocab"], spec["eos_id"], spec["mask_id"], d_model=spec["d_model"],
                                 n_heads=spec["n_heads"], n_kv_heads=spec["n_kv_heads"], n_layers=spec["n_layers"],
                                 mlp_hidden_size=spec["mlp_hidden_size"], max_sequence_length=4096)
    hf = llama_config_from_llada(cfg)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf)
    finally:
        torch.set_default_dtype(before)
    if {p.dtype for p in model.parameters()} != {dtype}:  # a transformers that ignores the default dtype
        model = model.to(dtype)  # (this also rounds the float32 RoPE buffers; built as above they stay float32)
    model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=g)
            elif name == "lm_head.weight":
                p.normal_(0.0, head_scale / p.shape[1] ** 0.5, generator=g)
                p[spec["mask_id"]] = 0.0
            else:
                scale = qk_scale if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                p.normal_(0.0, scale / p.shape[1] ** 0.5, generator=g)
    dllm = DllmConfig(family="llada", mask_token_id=spec["mask_id"], attention="bidirectional", block_size=32,
                      logit_shift=False, eos_token_ids=[spec["eos_id"], spec["eot_id"]], pad_token_id=spec["eos_id"],
                      default_sampling={"temperature": 0.0})
    return LoadedModel.from_module(model, word_tokenizer(spec), dllm, path=f"<random llada {spec['d_model']}>")


def transfer_counts(masked: "torch.Tensor", steps: int) -> "torch.Tensor":
    """``[B, steps]``: how many positions each step of a block reveals, per row: the row's masked count split
    evenly over the steps, the remainder one each to the first steps (LLaDA's linear schedule)."""
    import torch

    base, extra = masked // steps, masked % steps
    return base[:, None] + (torch.arange(steps, device=masked.device)[None] < extra[:, None]).long()


def reference_generate(lm, prompts, new_tokens: int, block: int, steps: int, mask_id: int):
    """LLaDA's published ``generate()`` algorithm as a plain PyTorch loop: the canvas ``prompt | masks``,
    decoded block by block, ``steps / blocks`` steps per block; each step forwards the whole canvas
    (bidirectional: every position sees every position), takes each masked position's argmax (temperature 0)
    and its softmax probability as the confidence, and reveals per row the :func:`transfer_counts` most confident
    masked positions of the current block; revealed tokens are final. ``lm``: a transformers Llama causal LM
    (``.model``, ``.lm_head``); ``prompts``: ``[B, P]`` int64 on its device. Returns ``[B, new_tokens]``.

    Written to be comparable bit for bit with the engine's no-cache decoding, in ways that do not change the
    algorithm: the LM head runs only on the current block's masked rows (the only logits the algorithm reads),
    the softmax is taken in float64 on float32 logits (LLaDA's dtype varies by version; bf16 probabilities would
    tie), and the mask token's logit is -inf (its head row is zero here; LLaDA's never wins either)."""
    import torch

    B, P = prompts.shape
    L = P + new_tokens
    dev = prompts.device
    x = torch.full((B, L), mask_id, dtype=torch.long, device=dev)
    x[:, :P] = prompts
    allowed = torch.ones(B, 1, L, L, dtype=torch.bool, device=dev)
    positions = torch.arange(L, device=dev)[None].expand(B, L)
    blocks = new_tokens // block
    per_block = steps // blocks
    with torch.no_grad():
        for b in range(blocks):
            lo, hi = P + b * block, P + (b + 1) * block
            counts = transfer_counts((x[:, lo:hi] == mask_id).sum(1), per_block)
            for s in range(per_block):
                masked = x[:, lo:hi] == mask_id  # [B, block]
                hidden = lm.model(input_ids=x, position_ids=positions, attention_mask=allowed,
                                  use_cache=False).last_hidden_state[:, lo:hi]
                logits = lm.lm_head(hidden[masked]).float()  # [N, V]: the block's masked rows, row-major
                logits[:, mask_id] = float("-inf")
                cand = logits.argmax(-1)
                conf = torch.softmax(logits.double(), -1).gather(-1, cand[:, None])[:, 0]
                confidence = torch.full((B, block), float("-inf"), dtype=torch.float64, device=dev)
                confidence[masked] = conf
                proposal = x[:, lo:hi].clone()
                proposal[masked] = cand
                for j in range(B):
                    k = int(counts[j, s])
                    if k:
                        idx = torch.topk(confidence[j], k).indices
                        x[j, lo + idx] = proposal[j, idx]
    return x[:, P:]


def _timed(fn, device: str):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def match_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    total = sum(max(len(x), len(y)) for x, y in zip(a, b))
    same = sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b))
    return same / total if total else 1.0


def speed(model, device: str, run: dict, require_equal: bool, deadline: float, seed: int = 1) -> dict:
    """Tokens/s of the engine (cache ``none`` and ``dual``) and of :func:`reference_generate` at each batch of
    ``run`` (prompt, new tokens, block; one token per step), on the same random prompts, and each engine run's
    token match fraction against the reference of the same batch. ``require_equal``: cache none must give the
    reference's tokens (float32: the same algorithm, and float32 rounding cannot flip these decisive models'
    decisions); otherwise (bfloat16) the fraction is reported: bf16 rounds each op's output, the engine and the
    loop run a few ops in other shapes (the engine forwards the batch's rows in its own grouping), and one
    flipped near-tie changes every later step's canvas. The dual cache is Fast-dLLM's approximation: reported.
    Runs past ``deadline`` (``time.perf_counter()``) are skipped and say so."""
    import torch
    from unmask.engine import LLM, SamplingParams

    spec_mask = model.dllm.mask_token_id
    P, G, block = run["prompt"], run["new_tokens"], run["block"]
    g = torch.Generator().manual_seed(seed)
    low = min(model.dllm.eos_token_ids + [spec_mask])
    all_prompts = torch.randint(0, low, (max(run["batches"]), P), generator=g)
    out = {"settings": {**run, "steps": G, "remasking": "low_confidence", "temperature": 0,
                        "dtype": str(model.dtype).removeprefix("torch."), "require_equal": require_equal},
           "rows": []}
    caches = ("none", "dual")

    def engine_run(prompts, cache):
        llm = LLM(model, max_batch_size=len(prompts))
        params = SamplingParams(max_tokens=G, steps=G, block_size=block, temperature=0.0, remasking="low_confidence",
                                cache=cache, ignore_eos=True)
        outs = llm.generate([p.tolist() for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    def reference_run(prompts):
        return reference_generate(model.model, prompts.to(device), G, block, G, spec_mask).tolist()

    # warm-up (kernel selection, allocator): one short run of each, not timed
    reference_generate(model.model, all_prompts[:1].to(device), block, block, block, spec_mask)
    engine_run(all_prompts[:1], "none")
    ok = True
    for B in run["batches"]:
        prompts = all_prompts[:B]
        if time.perf_counter() > deadline:
            out["rows"].append({"batch": B, "skipped": "over the time budget"})
            continue
        ref, t_ref = _timed(lambda: reference_run(prompts), device)
        row = {"batch": B, "reference": {"seconds": round(t_ref, 3), "tokens_per_s": round(B * G / t_ref, 1)}}
        for cache in caches:
            toks, t = _timed(lambda: engine_run(prompts, cache), device)
            frac = match_fraction(toks, ref)
            row[f"engine_cache_{cache}"] = {"seconds": round(t, 3), "tokens_per_s": round(B * G / t, 1),
                                            "x_reference": round(t_ref / t, 2), "match_reference": round(frac, 4)}
            if cache == "none" and require_equal:
                row[f"engine_cache_{cache}"]["equal"] = toks == ref
                ok = ok and toks == ref
        out["rows"].append(row)
        log(f"speed B={B}: reference {row['reference']['tokens_per_s']} tok/s, engine none "
            f"{row['engine_cache_none']['tokens_per_s']} (match {row['engine_cache_none']['match_reference']}), "
            f"dual {row['engine_cache_dual']['tokens_per_s']} (match {row['engine_cache_dual']['match_reference']})")
    out["ok"] = ok if require_equal else None
    return out


# ------------------------------------------------------------------ 5. cuda graphs of the post-forward step
GRAPH_ROWS = (32, 256, 1024)  # batch 1, 8, 32 x a block of 32 masked rows


def graph_step_inputs(rows: int, vocab: int, mixed: bool, device: str, seed: int = 0):
    """One step's reveal-pass inputs: ``rows`` rows in sequences of 32 (a block each), ``[rows, vocab]`` random
    logits on ``device``; greedy quota decoding, or (``mixed``) every second sequence sampled, with top-k, top-p,
    the margin / random / left-to-right strategies and thresholds among them. Returns ``(logits, groups,
    segments)``."""
    import torch
    from unmask.engine import SamplingParams
    from unmask.engine.noise import Draws
    from unmask.engine.sampler import RowGroup

    groups, segments = [], []
    for i, lo in enumerate(range(0, rows, 32)):
        hi = min(rows, lo + 32)
        kind = i % 4 if mixed else 0
        params = SamplingParams(temperature=0.8 if kind % 2 else 0.0, top_k=50 if kind == 1 else 0,
                                top_p=0.9 if kind == 3 else 1.0, seed=seed + i,
                                remasking=("low_confidence", "margin", "random", "left_to_right")[kind])
        groups.append(RowGroup(lo, hi, params, Draws(seed + i, 3, list(range(100 + lo, 100 + hi)))))
        segments.append((lo, hi, None, 0.9) if kind % 2 else (lo, hi, 2, None))
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, vocab, device=device, generator=g) * 4, groups, segments


def same_step(a, b) -> tuple[bool, bool, float]:
    """``(agree, bitwise, largest difference)`` of two reveal-pass results ``(candidates, chosen)``: ``agree`` =
    tokens and reveals equal, probabilities and scores within 1e-9, log-probabilities within float32 rounding (a
    GPU's row reductions may split a row by the row count: its float64 sums move in the last bits, the contracts'
    GPU float32 column); ``bitwise``: every output equal (what a CPU gives)."""
    import torch

    (ca, cha), (cb, chb) = a, b
    fields = ("tokens", "probability", "logprob", "score")
    bitwise = all(torch.equal(getattr(ca, f), getattr(cb, f)) for f in fields) and torch.equal(cha, chb)
    diff = max(float((getattr(ca, f).double() - getattr(cb, f).double()).abs().max()) if len(ca.tokens) else 0.0
               for f in ("probability", "score"))
    agree = (torch.equal(ca.tokens, cb.tokens) and torch.equal(cha, chb) and diff <= 1e-9
             and torch.allclose(ca.logprob, cb.logprob, rtol=1e-6, atol=1e-6))
    return agree, bitwise, diff


def _paired_ms(fns, device: str, reps: int) -> list[float]:
    """Median milliseconds of each of ``fns`` over ``reps`` rounds, the calls alternating within a round (a busy
    machine's load falls on both alike)."""
    import statistics

    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            times[i].append(_timed(fn, device)[1])
    return [round(1000 * statistics.median(t), 3) for t in times]


def graph_step_rows(device: str, vocab: int, rows_list, reps: int) -> tuple[list, bool]:
    """Eager pass vs :class:`~unmask.engine.step_graphs.StepGraphs` (captured on CUDA, the uncaptured static step
    elsewhere) at each row count, greedy and mixed: :func:`same_step` on three steps of other values (``equal``:
    they agree; ``bitwise``; ``max_diff``), and the median per-step time of both, alternating (the host's table building
    and the copies included)."""
    import torch
    from unmask.engine.reveal_rule import select_segments
    from unmask.engine.sampler import sample_groups
    from unmask.engine.step_graphs import StepGraphs

    def eager(logits, groups, segments):
        cands = sample_groups(logits.clone(), groups)
        return cands, select_segments(cands, segments)

    out, ok = [], True
    for rows in rows_list:
        for mixed in (False, True):
            graphs = StepGraphs(device, capture=device == "cuda")
            row = {"rows": rows, "mixed": mixed, "equal": True, "bitwise": True, "max_diff": 0.0}
            with torch.inference_mode():
                for seed in range(3):  # the first captures, the others replay on new values
                    inputs = graph_step_inputs(rows, vocab, mixed, device, seed)
                    agree, bitwise, diff = same_step(eager(*inputs),
                                                     graphs.sample_and_select(inputs[0].clone(), *inputs[1:]))
                    row["equal"] &= agree
                    row["bitwise"] &= bitwise
                    row["max_diff"] = max(row["max_diff"], diff)
                row["eager_ms"], row["graph_ms"] = _paired_ms(
                    [lambda: eager(*inputs), lambda: graphs.sample_and_select(inputs[0].clone(), *inputs[1:])],
                    device, reps)
            row["x_eager"] = round(row["eager_ms"] / row["graph_ms"], 2)
            row["stats"] = dict(graphs.stats)
            ok &= row["equal"]
            out.append(row)
            log(f"cuda graphs {rows} rows {'mixed' if mixed else 'greedy'}: equal {row['equal']} (bitwise "
                f"{row['bitwise']}, max diff {row['max_diff']:.1e}), eager "
                f"{row['eager_ms']} ms, {'replay' if device == 'cuda' else 'static'} {row['graph_ms']} ms")
    return out, ok


def graphs_section(device: str, lane, small: bool, reps: int = 20) -> dict:
    """Section 5: the post-forward step's CUDA graphs (see the module docstring)."""
    import torch

    vocab = SMALL["vocab"] if small else LLADA_8B["vocab"]
    out: dict = {"vocab": vocab, "reps": reps}
    out["steps"], ok = graph_step_rows(device, vocab, GRAPH_ROWS[:2] if small else GRAPH_ROWS, reps)
    import decoding_paths
    from unmask.engine import SamplingParams

    prompts = [decoding_paths.PROMPTS[i % len(decoding_paths.PROMPTS)] for i in range(8)]
    params = SamplingParams(temperature=0.8, seed=3, block_size=4, max_tokens=16, ignore_eos=True, speculative=False)
    if device != "cuda":
        try:
            lane.llm("causal", device, torch.float32, cuda_graphs=True)
            out["refused_on_cpu"] = False
        except ValueError as exc:
            out["refused_on_cpu"] = "cuda_graphs" in str(exc)
        out["ok"] = ok and out["refused_on_cpu"]
        return out
    runs = {}
    for graphs in (False, True):
        llm = lane.llm("causal", device, torch.float32, max_batch_size=8, enable_prefix_caching=False,
                       cuda_graphs=graphs)
        llm.generate(prompts[:1], params)  # warm-up (and the first capture)
        toks, t = _timed(lambda: [o.outputs[0].token_ids for o in llm.generate(prompts, params)], device)
        runs[graphs] = {"tokens": toks, "seconds": round(t, 3)}
        if graphs:
            runs[graphs]["stats"] = dict(llm.denoiser.step_graphs.stats)
    equal = runs[True]["tokens"] == runs[False]["tokens"]
    out["engine"] = {"batch": 8, "equal_tokens": equal, "seconds_eager": runs[False]["seconds"],
                     "seconds_graphs": runs[True]["seconds"], "stats": runs[True]["stats"]}
    log(f"cuda graphs engine batch 8: equal tokens {equal}, eager {runs[False]['seconds']} s, graphs "
        f"{runs[True]['seconds']} s, {runs[True]['stats']}")
    out["ok"] = ok and equal
    return out


# ------------------------------------------------------------------ main
def write(out_path: Path, result: dict) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, out_path)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to run (default cuda)")
    ap.add_argument("--small", action="store_true",
                    help="a small LLaDA-shaped float32 model instead of the 8B shape (the CI run)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSON (default {DEFAULT_OUT})")
    ap.add_argument("--check-env-only", action="store_true", help="the environment section only")
    ap.add_argument("--skip-lane", action="store_true", help="leave out the cuda lane")
    ap.add_argument("--skip-graphs", action="store_true", help="leave out the cuda graphs section")
    ap.add_argument("--skip-speed", action="store_true",
                    help="leave out the speed sections (with --skip-lane: the environment, host syncs and cuda graphs "
                         "only, about a minute)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads with --device cpu (default 1: tiny models run fastest on one)")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="speed runs that would start after this many seconds are skipped (default 270)")
    return ap.parse_args(argv)


def prepare(args) -> str:
    """Environment variables, ``tests/`` on the path, the ``unmask`` package, torch's threads; returns how
    ``unmask`` is imported (:func:`use_source_tree`)."""
    for key, value in (("TOKENIZERS_PARALLELISM", "false"), ("HF_HUB_OFFLINE", "1"), ("TQDM_DISABLE", "1"),
                       ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
        os.environ.setdefault(key, value)
    sys.path.insert(0, str(TESTS))
    source = use_source_tree()
    import torch

    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    return source


def lane_and_syncs(args, result: dict, required: dict) -> None:
    """Sections 2, 3 and 5 on one set of lane checkpoints."""
    import cuda_lane

    lane = cuda_lane.Lane()
    try:
        if not args.skip_lane:
            try:
                result["cuda_lane"] = lane_section(args.device, lane)
                required["cuda_lane"] = all(v["summary"]["failed"] == 0 for k, v in result["cuda_lane"].items()
                                            if k != "rules")
            except Exception as exc:  # noqa: BLE001 - report and go on
                result["cuda_lane"] = {"error": error_text(exc)}
                required["cuda_lane"] = False
            write(args.out, result)
        result["host_syncs"] = syncs_section(args.device, lane)
        for name, case in result["host_syncs"].get("cases", {}).items():
            log(f"host syncs {name}: {case}")
        write(args.out, result)
        if not args.skip_graphs:
            try:
                result["cuda_graphs"] = graphs_section(args.device, lane, args.small)
                required["cuda_graphs"] = result["cuda_graphs"]["ok"]
            except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported
                result["cuda_graphs"] = {"error": error_text(exc)}
                required["cuda_graphs"] = False
            write(args.out, result)
    finally:
        lane.close()


def speed_sections(args, result: dict, required: dict, deadline: float) -> None:
    """Section 4 (and, on a GPU run, the small float32 model's equal-token check first)."""
    import torch

    if not args.small:
        try:
            result["reference_equality"] = speed(build_llada(SMALL, args.device, torch.float32), args.device,
                                                 SMALL_RUN, True, float("inf"))
            required["reference_equality"] = result["reference_equality"]["ok"]
        except Exception as exc:  # noqa: BLE001
            result["reference_equality"] = {"error": error_text(exc)}
            required["reference_equality"] = False
        write(args.out, result)
    try:
        t0 = time.perf_counter()
        spec, run, dtype = (SMALL, SMALL_RUN, torch.float32) if args.small else (LLADA_8B, FULL_RUN, torch.bfloat16)
        model = build_llada(spec, args.device, dtype)
        log(f"built the {'small' if args.small else 'LLaDA-8B-shaped'} model in {time.perf_counter() - t0:.1f} s")
        result["speed"] = speed(model, args.device, run, args.small, deadline)
        result["speed"]["model"] = spec
        if args.small:
            required["speed_equal_tokens"] = result["speed"]["ok"]
    except Exception as exc:  # noqa: BLE001
        result["speed"] = {"error": error_text(exc)}
        required["speed"] = False


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    source = prepare(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available() and not args.check_env_only:
        print(f"gpu_check: error: --device cuda: torch {torch.__version__} (CUDA build {torch.version.cuda}) "
              "sees no CUDA device; use --device cpu --small, or --check-env-only", file=sys.stderr)
        return 2
    result: dict = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                    "unmask_import": source, "settings": {"device": args.device, "small": args.small}}
    env = result["environment"] = environment(args.device)
    log(f"torch {env['torch']} (CUDA {env['torch_cuda_build']}), transformers {env['transformers']}, "
        f"driver {env['driver_version']}, GPU {env.get('gpu_name')}")
    if args.check_env_only:
        result["seconds"] = round(time.perf_counter() - t_start, 2)
        write(args.out, result)
        print(json.dumps(env, indent=2, default=str))
        return 0
    import unmask.engine  # noqa: F401  (needs neither llguidance nor the server stack)

    required: dict[str, bool] = {}
    lane_and_syncs(args, result, required)
    if not args.skip_speed:
        speed_sections(args, result, required, t_start + args.budget_s)
    result["required"] = required
    result["ok"] = all(required.values())
    result["seconds"] = round(time.perf_counter() - t_start, 2)
    write(args.out, result)
    log(f"required checks: {required}; {'OK' if result['ok'] else 'FAILED'} in {result['seconds']} s; "
        f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
