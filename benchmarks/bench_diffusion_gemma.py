"""DiffusionGemma: the engine against transformers' ``DiffusionGemmaForBlockDiffusion.generate()`` on the same random
weights and settings (issue 43).

Two random replicas saved in DiffusionGemma's own layout (``tests/diffusion_gemma_tiny.py``) and loaded by the
family adapter, float32 on the CPU: ``tiny`` (the tests' replica: hidden 64, 3 layers, 4 experts, vocabulary 320) and
``0.5b`` (hidden 1024, 12 layers of which every sixth is full attention, 24 experts of 512 with top-4 beside a dense
MLP of 2048, vocabulary 32,000: ~0.55B parameters). Canvases of 32 tokens after 32-token prompts, EOS ignored on both
sides, in two sampler settings:

* ``defaults``: transformers' schedule and bound (t 0.4 -> 0.8, entropy bound 0.1, stability 1, confidence 0.005):
  on random weights adaptive stopping never fires, so every canvas takes all its steps on both sides;
* ``settling``: a near-argmax schedule (t 0.05 -> 0.1, entropy bound 1000, confidence 10): canvases settle after a
  varying number of steps, so adaptive stopping fires at different steps for different requests.

Two workloads, each with its own stable result name:

* ``batches`` (``results/bench_diffusion_gemma.*``, the default): 64 new tokens, ``max_denoising_steps`` 16, both
  settings; batch 1: each of the first ``--single`` prompts alone, through ``LLM.generate`` and through ``generate()``
  at batch 1 (``torch.manual_seed(seed)``), the tokens must be equal; batch 8: eight prompts through the engine's
  continuous batching (``max_batch_size`` 8) and through ``generate()``'s own batch of eight (one call; it draws
  over its whole batch, so its tokens are not the batch-1 ones, and a row that has stopped keeps riding along until
  every row of the batch has);
* ``lengths`` (``--workload lengths``, ``results/bench_diffusion_gemma_lengths.*``): serving traffic, eight requests
  whose ``max_tokens`` differ, a fixed spread of 1, 2, 3, 4, 1, 2, 3, 4 canvases (32 to 128 tokens),
  ``max_denoising_steps`` ``--lengths-steps`` (8), the ``defaults`` setting (no canvas stops early, so what differs is
  the lengths alone). The engine serves them by continuous batching (a request leaves when its last canvas is done);
  ``generate()`` runs them as one batch of eight with ``max_new_tokens`` = the longest (it has no per-row length),
  each row then cut to its own length. Both sides count only the tokens the requests asked for.

Reported per row: generated tokens per second (median of ``--repeats``, the two sides alternated), the ratio engine /
generate(), whether the engine's tokens equal ``generate()`` at batch 1 (for a batch: the engine's tokens of the
first ``--single`` requests equal their batch-1 ``generate()`` tokens, same prompt, seed and length), and where the
time goes on each side: the seconds inside the decoder's forward (``DiffusionGemmaForBlockDiffusion.forward``, the
same transformers module on both sides) and the encoder's, the rest being each side's own sampling and bookkeeping.

    .venv/bin/python benchmarks/bench_diffusion_gemma.py --repeats 3
    .venv/bin/python benchmarks/bench_diffusion_gemma.py --workload lengths --repeats 3
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import bench_common as bc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

REPLICAS = {
    "tiny": {},
    "0.5b": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "global_head_dim": 256,
             "num_global_key_value_heads": 2, "sliding_window": 512, "layer_types": None, "num_experts": 24,
             "top_k_experts": 4, "moe_intermediate_size": 512},
}
SETTINGS = {
    "defaults": {"t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1, "stability_threshold": 1,
                 "confidence_threshold": 0.005},
    "settling": {"t_min": 0.05, "t_max": 0.1, "entropy_bound": 1000.0, "stability_threshold": 1,
                 "confidence_threshold": 10.0},
}
PROMPT_LEN, GEN, CANVAS, STEPS, SEED = 32, 64, 32, 16, 1000
LENGTH_CANVASES = [1, 2, 3, 4, 1, 2, 3, 4]  # the lengths workload's max_tokens, in canvases


class ForwardClock:
    """Seconds spent inside the model's decoder forward and its encoder, by whichever side calls them: both are
    instance attributes wrapped with a timer (``generate()`` calls ``self.forward`` and ``self.model.encoder``, the
    engine ``model(...)`` and ``model.model.encoder(...)``, so both sides go through the wrappers)."""

    def __init__(self, model):
        self.seconds = {"decoder": 0.0, "encoder": 0.0}
        model.forward = self._timed(model.forward, "decoder")
        model.model.encoder.forward = self._timed(model.model.encoder.forward, "encoder")

    def _timed(self, fn, part: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
        return timed

    def take(self) -> dict:
        """The seconds since the last call, by part; resets them."""
        out, self.seconds = self.seconds, {"decoder": 0.0, "encoder": 0.0}
        return out


def engine_run(llm, batch: list[list[int]], setting: dict, seed: int, lengths: list[int], steps: int):
    """``(seconds, tokens)``: ``batch`` through ``llm`` at once (request ``i``: seed ``seed + i``, ``lengths[i]``
    new tokens, EOS ignored)."""
    from unmask.engine import SamplingParams

    reqs = [(p, SamplingParams(max_tokens=n, seed=seed + i, max_denoising_steps=steps, ignore_eos=True, **setting))
            for i, (p, n) in enumerate(zip(batch, lengths))]
    t0 = time.perf_counter()
    out = dict(llm.generate_iter(reqs, lookahead=len(reqs)))
    return time.perf_counter() - t0, [out[i].outputs[0].token_ids for i in range(len(reqs))]


def reference_run(model, batch: list[list[int]], setting: dict, seed: int, lengths: list[int], steps: int):
    """``(seconds, tokens)``: ``generate()`` over ``batch`` in one call after ``torch.manual_seed(seed)``, with
    ``max_new_tokens`` = the longest of ``lengths``, row ``i`` cut to ``lengths[i]`` (EOS ignored, as the engine's
    ``ignore_eos``: its output keeps every canvas; no pad replaces tokens after an EOS)."""
    import torch
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    kw = {k: v for k, v in setting.items() if k != "entropy_bound"}
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(torch.tensor(batch), max_new_tokens=max(lengths), max_denoising_steps=steps,
                         eos_token_id=None, pad_token_id=None,
                         sampler_config=EntropyBoundSamplerConfig(setting["entropy_bound"]), **kw)
    rows = out.sequences[:, len(batch[0]):].tolist()
    return time.perf_counter() - t0, [r[:n] for r, n in zip(rows, lengths)]


class Batch1Reference:
    """``generate()``'s batch-1 tokens per ``(prompt, seed)`` for one setting and step count, the longest run kept
    (a shorter ``max_new_tokens`` gives its prefix: the same draws in the same order)."""

    def __init__(self, model, setting: dict, steps: int):
        self.model, self.setting, self.steps, self.runs = model, setting, steps, {}

    def put(self, prompt: list[int], seed: int, tokens: list[int]) -> None:
        key = (tuple(prompt), seed)
        if len(self.runs.get(key, ())) < len(tokens):
            self.runs[key] = tokens

    def get(self, prompt: list[int], seed: int, n: int) -> list[int]:
        if len(self.runs.get((tuple(prompt), seed), ())) < n:
            self.put(prompt, seed, reference_run(self.model, [prompt], self.setting, seed, [n], self.steps)[1][0])
        return self.runs[(tuple(prompt), seed)][:n]


def _median_parts(parts: list[dict]) -> dict:
    return {k: bc.median([p[k] for p in parts]) for k in parts[0]}


def measure_row(llm, model, clock, batches, setting: dict, steps: int, args, batch1: Batch1Reference) -> dict:
    """One row: ``batches`` (``(prompts, seed, lengths)`` each, timed one after another) through both sides,
    ``--repeats`` times alternated. A batch's engine tokens of its first ``--single`` requests are checked against
    ``batch1`` (which keeps the batch-1 rows' own reference runs)."""
    e_s, r_s, e_parts, r_parts, same, tokens = [], [], [], [], True, 0
    for rep in range(args.repeats):
        es = rs = 0.0
        tokens = 0
        ep, rp = {"decoder": 0.0, "encoder": 0.0}, {"decoder": 0.0, "encoder": 0.0}
        for prompts, seed, lengths in batches:
            clock.take()
            t, e_out = engine_run(llm, prompts, setting, seed, lengths, steps)
            es += t
            ep = {k: ep[k] + v for k, v in clock.take().items()}
            tokens += sum(len(x) for x in e_out)
            t, r_out = reference_run(model, prompts, setting, seed, lengths, steps)
            rs += t
            rp = {k: rp[k] + v for k, v in clock.take().items()}
            if len(prompts) == 1:
                same &= e_out == r_out
                batch1.put(prompts[0], seed, r_out[0])
            elif rep == 0:
                same &= all(e_out[j] == batch1.get(prompts[j], seed + j, lengths[j])
                            for j in range(min(args.single, len(prompts))))
        e_s.append(es)
        r_s.append(rs)
        e_parts.append(ep)
        r_parts.append(rp)
    e, r = bc.median(e_s), bc.median(r_s)
    return {"tokens": tokens, "engine_tokens_per_s": tokens / e, "generate_tokens_per_s": tokens / r, "ratio": r / e,
            "tokens_equal_batch1_generate": bool(same), "engine_seconds": e_s, "generate_seconds": r_s,
            "engine_forward_seconds": _median_parts(e_parts), "generate_forward_seconds": _median_parts(r_parts)}


def _load(name: str, overrides: dict):
    from diffusion_gemma_tiny import save_replica
    from unmask.engine.model import load_model

    with tempfile.TemporaryDirectory() as tmp:
        save_replica(tmp, canvas_length=CANVAS, **overrides)
        return load_model(tmp, device="cpu")


def measure(name: str, overrides: dict, args) -> list[dict]:
    """The rows of one replica: per sampler setting batch 1 and batch 8 (``batches``), or the lengths row."""
    from unmask.engine import LLM

    loaded = _load(name, overrides)
    model = loaded.model
    params_total = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n)
    llm = LLM(loaded, max_batch_size=8, enable_prefix_caching=False)  # the repeats resend the same prompts
    clock = ForwardClock(model)
    ps = bc.fixed_prompts(8, PROMPT_LEN, min(loaded.vocab_size, 320) - 1)  # ordinary ids
    if args.workload == "lengths":
        plan = [("defaults", "8 (lengths)", args.lengths_steps, [(ps, SEED, [CANVAS * c for c in LENGTH_CANVASES])])]
    else:
        plan = [(s, label, STEPS, batches) for s in SETTINGS
                for label, batches in (("1", [([p], SEED + i, [GEN]) for i, p in enumerate(ps[: args.single])]),
                                       ("8", [(ps, SEED, [GEN] * 8)]))]
    rows, references = [], {}
    for sname, label, steps, batches in plan:
        setting = SETTINGS[sname]
        engine_run(llm, ps[:1], setting, SEED, [CANVAS], steps)  # warm-up
        reference_run(model, ps[:1], setting, SEED, [CANVAS], steps)
        batch1 = references.setdefault((sname, steps), Batch1Reference(model, setting, steps))
        row = measure_row(llm, model, clock, batches, setting, steps, args, batch1)
        rows.append({"replica": name, "parameters": params_total, "setting": sname, "batch": label,
                     "requests": sum(len(b[0]) for b in batches), "max_denoising_steps": steps, **row})
        print(rows[-1], flush=True)
    return rows


def _share(parts: dict, seconds: float) -> str:
    """``"decoder% / encoder%"`` of ``seconds``."""
    return f"{100 * parts['decoder'] / seconds:.0f}% / {100 * parts['encoder'] / seconds:.0f}%"


def markdown(rows: list[dict], args) -> str:
    """The results table, where the time goes, and the settings line."""
    md = bc.markdown_table(
        ["replica", "params (text)", "setting", "batch", "engine tok/s", "generate() tok/s", "engine / generate()",
         "= generate() at batch 1"],
        [[r["replica"], f"{r['parameters'] / 1e6:.3g}M", r["setting"], r["batch"], r["engine_tokens_per_s"],
          r["generate_tokens_per_s"], r["ratio"], r["tokens_equal_batch1_generate"]] for r in rows])
    md += "\nWhere the time goes (medians over the repeats: seconds in all, share in the decoder's forward / the " \
          "encoder's; the rest is each side's own sampling and bookkeeping):\n\n"
    md += bc.markdown_table(
        ["replica", "setting", "batch", "engine s", "engine decoder / encoder", "engine rest s", "generate() s",
         "generate() decoder / encoder", "generate() rest s"],
        [[r["replica"], r["setting"], r["batch"], e, _share(r["engine_forward_seconds"], e),
          e - sum(r["engine_forward_seconds"].values()), g, _share(r["generate_forward_seconds"], g),
          g - sum(r["generate_forward_seconds"].values())]
         for r in rows for e, g in [(bc.median(r["engine_seconds"]), bc.median(r["generate_seconds"]))]])
    if args.workload == "lengths":
        md += (f"\nEight requests, max_tokens {', '.join(str(CANVAS * c) for c in LENGTH_CANVASES)} after "
               f"{PROMPT_LEN}-token prompts (EOS ignored on both sides), canvases of {CANVAS}, max_denoising_steps "
               f"{args.lengths_steps}, transformers' sampler defaults; the engine's continuous batching "
               "(max_batch_size 8) vs one generate() call over the eight with max_new_tokens = the longest, each row "
               "cut to its own length; tokens per second count only the requested tokens. ")
    else:
        md += (f"\nPrompts of {PROMPT_LEN} tokens, {GEN} new tokens (EOS ignored on both sides), canvases of {CANVAS}, "
               f"max_denoising_steps {STEPS}. Both sides run transformers' modules on the same weights; the engine's "
               "batch of 8 is continuous batching (a request leaves when its canvases are done, a canvas when its "
               "own adaptive stopping fires), generate()'s is one call (every row steps until the whole batch "
               "stops). ")
    return md + f"Medians of {args.repeats} alternated repeats; float32 on the CPU, {args.threads} thread(s).\n"


def main(argv: list[str] | None = None) -> int:
    """Run the replicas and write ``results/bench_diffusion_gemma.{json,md}`` (``--workload lengths``:
    ``results/bench_diffusion_gemma_lengths.{json,md}``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_replica_arguments(ap)
    ap.add_argument("--workload", choices=("batches", "lengths"), default="batches")
    ap.add_argument("--lengths-steps", type=int, default=8, help="max_denoising_steps of the lengths workload")
    args = bc.parse_args(ap, argv, threads=1)
    env = bc.environment(args.threads)
    rows = []
    for name in args.replicas.split(","):
        rows += measure(name, REPLICAS[name], args)
    settings = {"prompt_len": PROMPT_LEN, "canvas": CANVAS, "samplers": SETTINGS, "workload": args.workload}
    if args.workload == "lengths":
        settings.update(max_tokens=[CANVAS * c for c in LENGTH_CANVASES], max_denoising_steps=args.lengths_steps)
    else:
        settings.update(gen=GEN, max_denoising_steps=STEPS)
    name = "bench_diffusion_gemma" + ("_lengths" if args.workload == "lengths" else "")
    return bc.report(name, {"rows": rows, "environment": env, "settings": settings}, markdown(rows, args))


if __name__ == "__main__":
    bc.run_script(main)
