"""The QLoRA A2D memory formula of docs/big-model.md, checked on a scaled-down random Qwen3 on the CPU.

For each (LoRA rank, sequence length): a random ``Qwen3ForCausalLM`` (no download) with bitsandbytes NF4 linear
layers (bitsandbytes' CPU backend; the LM head and embedding stay float32 as transformers leaves them), peft LoRA
on q/k/v/o/gate/up/down, gradient checkpointing (non-reentrant), AdamW, a few training steps of the masked-diffusion
loss on a bidirectional attention mask (every position sees every other one, as an A2D model in ``mdlm`` training).
Memory is the process RSS sampled every 2 ms by a thread (/proc/self/statm): ``weights`` = RSS after building the
quantized model minus before; ``step peak`` = peak RSS during the steps (after one warm-up step, so AdamW's state
already exists) minus RSS just before them, i.e. the LoRA gradients and the activations. Freed heap pages are
returned to the OS (``malloc_trim``) before each baseline reading. Both are compared
with the formula (``formula_*``) the document uses for the 27B card, with float32 activations (the CPU computes in
float32; the GPU case is bf16: half).

    nice -n 10 .venv/bin/python benchmarks/qlora_memory.py --steps 3
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=8192)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trim() -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``), so that RSS tracks live memory."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak RSS (bytes) while the context is open, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        self.peak = rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def lora_params(shape: dict, rank: int) -> int:
    """LoRA parameters: ``rank x (in + out)`` per adapted projection per layer."""
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return rank * per_layer * L


def body_params(shape: dict) -> int:
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    return L * (h * q + 2 * h * kv + q * h + 3 * h * i)


def formula(shape: dict, rank: int, seq: int, act_bytes: int = 4) -> dict:
    """The document's terms, in bytes (batch 1)."""
    h, i, L, V = (shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    nf4 = body_params(shape) * (4 + 0.5) / 8  # 4 bits + one float32 absmax per 64 weights (no double quant)
    dense = 2 * V * h * 4  # embedding + untied LM head, float32
    lora = lora_params(shape, rank) * (4 + 4 + 8)  # weight, gradient, AdamW m and v (float32)
    ckpt = L * seq * h * act_bytes  # one hidden state per layer kept by gradient checkpointing
    # one layer recomputed for its backward: inputs of every projection and LoRA, attention outputs, MLP
    # intermediates (gate, up, act, product), with their gradients; attention probabilities are not kept (SDPA)
    layer = seq * act_bytes * (6 * h + 2 * q + 2 * kv + 5 * i) * 2
    logits = seq * V * 4 * 3  # float32 logits, log-softmax and its gradient
    return {"weights": nf4 + dense, "lora_and_adam": lora, "checkpointed": ckpt, "one_layer": layer,
            "logits": logits, "lora_grads": lora_params(shape, rank) * 4,
            "step_total": lora_params(shape, rank) * 4 + ckpt + layer + logits}


def run(rank: int, seq: int, steps: int, tmp: Path) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, Qwen3Config, Qwen3ForCausalLM

    src = tmp / "qwen3-small"
    if not (src / "config.json").exists():
        torch.manual_seed(0)
        cfg = Qwen3Config(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=False)
        Qwen3ForCausalLM(cfg).save_pretrained(src)
        del cfg
    gc.collect()
    trim()
    before = rss()
    model = Qwen3ForCausalLM.from_pretrained(
        src, attn_implementation="sdpa", dtype=torch.float32, device_map={"": "cpu"},
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32))
    gc.collect()
    trim()
    weights = rss() - before
    # the bytes the model's tensors hold (NF4 codes, absmax, float32 embedding/head/norms): the formula's term exactly
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    tensor_bytes += sum(m.weight.quant_state.absmax.numel() * m.weight.quant_state.absmax.element_size()
                        for m in model.modules() if getattr(getattr(m, "weight", None), "quant_state", None) is not None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    model.train()  # from_pretrained returns eval mode, where transformers skips gradient checkpointing silently
    assert model.base_model.model.model.layers[0].gradient_checkpointing
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"] - 1, (1, seq), generator=g)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool)  # bidirectional (A2D)

    def step():
        masked = torch.rand(1, seq, generator=g) < 0.5
        x = ids.masked_fill(masked, SHAPE["vocab_size"] - 1)
        logits = model(input_ids=x, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits[masked].float(), ids[masked])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: one-time allocations (kernels' buffers, the optimizer's m and v) happen here
    gc.collect()
    trim()
    start = rss()
    t0 = time.perf_counter()
    with PeakRss() as peak:
        for _ in range(steps):
            step()
    sec = (time.perf_counter() - t0) / steps
    f = formula(SHAPE, rank, seq)
    out = {"rank": rank, "seq": seq, "lora_params": n_lora, "lora_params_formula": lora_params(SHAPE, rank),
           "weights_rss_mb": weights / 2**20, "weights_tensor_mb": tensor_bytes / 2**20, "formula_weights_mb": f["weights"] / 2**20,
           "step_peak_mb": (peak.peak - start) / 2**20, "formula_step_mb": f["step_total"] / 2**20,
           "formula_terms_mb": {k: v / 2**20 for k, v in f.items()}, "seconds_per_step": sec,
           "tokens_per_s": seq / sec}
    del model, opt
    gc.collect()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--seqs", default="256,1024")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tmp", default="/tmp/unmask-qlora-memory")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        for rank in [int(r) for r in args.ranks.split(",")]:
            rows.append(run(rank, seq, args.steps, tmp))
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    data = {"shape": SHAPE, "targets": TARGETS, "rows": rows, "torch": torch.__version__,
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": list(os.getloadavg()),
            "command": "nice -n 10 .venv/bin/python benchmarks/qlora_memory.py " + " ".join(argv or [])}
    (RESULTS / "qlora_memory.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = ["| rank | seq | LoRA params (formula) | weight tensors MB (formula) | weights RSS MB | step peak RSS MB "
             "(formula) | s/step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rank']} | {r['seq']} | {r['lora_params']:,} ({r['lora_params_formula']:,}) | "
                     f"{r['weights_tensor_mb']:.1f} ({r['formula_weights_mb']:.1f}) | {r['weights_rss_mb']:.1f} | "
                     f"{r['step_peak_mb']:.1f} ({r['formula_step_mb']:.1f}) | {r['seconds_per_step']:.2f} |")
    # differences cancel the process's fixed overheads (allocator, library buffers): slopes against the formula's
    by = {(r["rank"], r["seq"]): r for r in rows}
    ranks, seqs = sorted({r["rank"] for r in rows}), sorted({r["seq"] for r in rows})
    lines += ["", "| difference | measured step peak MB | formula MB |", "|---|---|---|"]
    for a, b in zip(seqs, seqs[1:]):
        for rk in ranks:
            d = by[(rk, b)]["step_peak_mb"] - by[(rk, a)]["step_peak_mb"]
            f = by[(rk, b)]["formula_step_mb"] - by[(rk, a)]["formula_step_mb"]
            lines.append(f"| r{rk}: seq {a} -> {b} | {d:.1f} | {f:.1f} |")
    for a, b in zip(ranks, ranks[1:]):
        for sq in seqs:
            d = by[(b, sq)]["step_peak_mb"] - by[(a, sq)]["step_peak_mb"]
            f = by[(b, sq)]["formula_step_mb"] - by[(a, sq)]["formula_step_mb"]
            lines.append(f"| seq {sq}: r{a} -> r{b} | {d:.1f} | {f:.1f} |")
    (RESULTS / "qlora_memory.md").write_text(f"Command: `{data['command']}`  \nMeasured {data['utc']}, torch "
                                             f"{data['torch']}, load average {data['loadavg'][0]:.1f}.\n\n"
                                             + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
