"""Bytes moved by the KV cache per decoding step, before and after the paged KV pool (issue 42).

What is counted: every key/value byte written by a data-movement op (``copy_``, ``cat``, ``stack``, ``clone``,
``index``, ``index_put_``, ``fill_``/``zero_``, ``_to_copy``, ...) on a floating-point tensor while the engine is
inside its KV-cache code: ``BatchKV.update`` / ``lane_update`` / ``lane_keys`` / ``lane_segments`` / ``commit``,
``LaneCache.append`` and ``PrefixCache.load`` / ``register`` (a :class:`TorchDispatchMode` entered around them;
whatever of these methods the measured tree defines). Against it: the forwarded chunk's own keys/values (the
``key_states`` and ``value_states`` handed to the cache, every layer): issue 42's target is moved <= that, i.e. a
step moves the new rows' K/V and no cached ones.

Two trees run the same scenarios: this checkout ("after") and ``--before`` (a commit, default 9267790: one buffer per
lane and layer, the cache before the pool; extracted with ``git archive`` into a temporary directory and run in a
subprocess that imports its ``unmask``). Scenarios, a tiny Llama (2 layers, 2 KV heads x 16, context 2048) written as
a checkpoint and loaded with ``--weights`` (native: the transformers forward with lane attention; fp16: the fused
decoder; int8: row-invariant attention):

* ``decode``: ``--batch`` requests with distinct ``--prompt``-token prompts decode ``--max-tokens`` tokens (block 4,
  greedy, prefix caching off); per-step figures are medians over the steps where every running request is decoding
  (no prefill, none waiting).
* ``shared-prefix``: one request stores a ``--prompt``-token system prompt, then ``--batch`` requests extending it
  by 8 tokens join (prefix caching on): bytes moved by the step they join in (the loads) and per decoding step.

Counts, not times: the same on any machine for the same code.

    .venv/bin/python benchmarks/bench_kv_bytes.py [--before 9267790] [--batch 8] [--prompt 1024]

Writes ``benchmarks/results/bench_kv_bytes.{json,md}``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_kv_bytes"
BEFORE = "9267790"
WEIGHTS = ("native", "fp16", "int8")
HOOKS = {"unmask.engine.kv_cache": {"BatchKV": ("update", "lane_update", "lane_keys", "lane_segments", "commit"),
                                    "LaneCache": ("append",)},
         "unmask.engine.prefix_cache": {"PrefixCache": ("load", "register")}}


class Counter:
    """Bytes moved inside the hooked methods, and the chunks' own K/V bytes handed to the cache."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        outputs = {aten.copy_.default, aten.cat.default, aten.stack.default, aten.clone.default, aten.index.Tensor,
                   aten.fill_.Scalar, aten.zero_.default, aten._to_copy.default, aten.slice_scatter.default,
                   aten.index_select.default, aten.gather.default, aten.constant_pad_nd.default,
                   aten.new_zeros.default, aten.zeros_like.default}
        values_arg = {aten.index_put_.default, aten._index_put_impl_.default, aten.index_put.default}
        counter = self
        self.moved = 0
        self.chunk = 0
        self.depth = 0

        def nbytes(t) -> int:
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.is_floating_point() else 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in values_arg:
                    counter.moved += nbytes(args[2])
                elif func in outputs:
                    counter.moved += nbytes(out if not isinstance(out, (tuple, list)) else out[0])
                return out

        self.mode = Mode()

    def wrap(self, cls, name: str) -> None:
        fn = cls.__dict__.get(name)
        if fn is None:
            return
        counter = self

        def wrapped(obj, *args, **kwargs):
            if name in ("update", "lane_update"):
                k, v = args[0], args[1]
                counter.chunk += k.numel() * k.element_size() + v.numel() * v.element_size()
            counter.depth += 1
            if counter.depth == 1:
                counter.mode.__enter__()
            try:
                return fn(obj, *args, **kwargs)
            finally:
                counter.depth -= 1
                if counter.depth == 0:
                    counter.mode.__exit__(None, None, None)

        setattr(cls, name, wrapped)

    def take(self) -> tuple[int, int]:
        got = (self.moved, self.chunk)
        self.moved = self.chunk = 0
        return got


def _ids(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 300, (n,), generator=g).tolist()


def run_tree(args) -> dict:
    """Both scenarios for each weight format in this process's ``unmask``."""
    sys.path.insert(0, str(args.tests))
    import tiny
    from unmask.engine import SamplingParams
    from unmask.engine.checkpoint import write_checkpoint
    from unmask.engine.engine import Engine
    from unmask.engine.model import load_model

    counter = Counter()
    for module, classes in HOOKS.items():
        mod = importlib.import_module(module)
        for cls_name, names in classes.items():
            for name in names:
                counter.wrap(getattr(mod, cls_name), name)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        m = tiny.loaded(block_size=4, initializer_range=0.5, max_position_embeddings=2048)
        ckpt = write_checkpoint(Path(tmp) / "tiny", m.model, m.tokenizer, m.dllm)
        cfg = m.model.config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
        for weights in args.weights:
            model = load_model(str(ckpt), weights=weights, dtype="float32")
            per_token_bytes = per_token * 4
            params = SamplingParams(max_tokens=args.max_tokens, block_size=4, temperature=0.0, ignore_eos=True)
            # decode
            engine = Engine(model, enable_prefix_caching=False, max_batch_size=args.batch)
            for i in range(args.batch):
                engine.add_request(_ids(args.prompt + i, 10 + i), params, f"r{i}")
            steps = []
            while engine.has_unfinished():
                running = list(engine.scheduler.running)
                decoding = bool(running) and all(s.nfe and not s.finished for s in running)  # no prefill
                counter.take()
                engine.step()
                moved, chunk = counter.take()
                if decoding and not engine.scheduler.waiting:
                    steps.append((moved, chunk))
            cached = args.prompt * args.batch
            results[f"decode/{weights}"] = summary(steps, cached, per_token_bytes)
            # shared prefix
            engine = Engine(model, enable_prefix_caching=True, max_batch_size=args.batch)
            system = _ids(args.prompt, 99)
            engine.add_request(system, params, "first")
            while engine.has_unfinished():
                engine.step()
            counter.take()
            for i in range(args.batch):
                engine.add_request(system + _ids(8, 200 + i), params, f"s{i}")
            engine.step()  # the joins: loads and the prefills after the prefix
            join, join_chunk = counter.take()
            steps = []
            while engine.has_unfinished():
                running = list(engine.scheduler.running)
                engine.step()
                moved, chunk = counter.take()
                if running and all(s.nfe and not s.finished for s in running):
                    steps.append((moved, chunk))
            row = summary(steps, cached, per_token_bytes)
            row.update(join_moved=join, join_chunk=join_chunk)
            results[f"shared-prefix/{weights}"] = row
    return results


def summary(steps: list[tuple[int, int]], cached_tokens: int, per_token: int) -> dict:
    """Medians over the measured steps."""
    moved = [m for m, _ in steps]
    chunk = [c for _, c in steps]
    return {"steps": len(steps), "moved_per_step": statistics.median(moved) if moved else None,
            "chunk_kv_per_step": statistics.median(chunk) if chunk else None,
            "ratio": (statistics.median(moved) / statistics.median(chunk)) if chunk and statistics.median(chunk) else None,
            "cached_kv_bytes": cached_tokens * per_token}


def run_before(args) -> dict:
    """The scenarios under ``--before``'s tree (``git archive`` into a temporary directory, a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "unmask"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
        site = next(p for p in sys.path if p.endswith("site-packages"))
        env = dict(os.environ, PYTHONPATH=tmp)
        cmd = [sys.executable, "-S", "-c",
               f"import sys; sys.path.append({site!r}); sys.argv = {[__file__, '--child', '--tests', str(src / 'tests'), '--batch', str(args.batch), '--prompt', str(args.prompt), '--max-tokens', str(args.max_tokens), '--weights', *args.weights]!r}; "
               f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tmp)
        return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(data: dict) -> str:
    lines = [f"# KV bytes moved per step (issue 42)\n\n`{data['command']}`: tiny Llama (2 layers, 2 KV heads x 16, "
             f"float32), {data['batch']} requests x {data['prompt']}-token prompts, block 4, greedy; before = commit "
             f"{data['before_commit']}. Medians over the steps where every running request decodes. `moved` = K/V bytes written by data-movement ops inside the KV "
             "cache's code; `chunk` = the forwarded rows' own K/V handed to the cache (target: moved <= chunk).\n",
             "| scenario | weights | before: moved / step | after: moved / step | chunk K/V / step | before ratio | "
             "after ratio | cached K/V | join step moved: before / after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, after in data["after"].items():
        before = data["before"].get(key, {})
        scen, weights = key.split("/")
        join = (f"{before.get('join_moved', 0):,} / {after.get('join_moved', 0):,}" if "join_moved" in after else "")
        fmt = (lambda x: f"{x:,.0f}" if isinstance(x, (int, float)) else "-")  # noqa: E731
        ratio = (lambda x: f"{x:.2f}" if isinstance(x, (int, float)) else "-")  # noqa: E731
        lines.append(f"| {scen} | {weights} | {fmt(before.get('moved_per_step'))} | {fmt(after['moved_per_step'])} "
                     f"| {fmt(after['chunk_kv_per_step'])} | {ratio(before.get('ratio'))} | {ratio(after['ratio'])} "
                     f"| {fmt(after['cached_kv_bytes'])} | {join} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help="the commit measured as 'before' (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=WEIGHTS)
    ap.add_argument("--tests", default=str(ROOT / "tests"), help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(run_tree(args)))
        return
    data = {"command": "python benchmarks/bench_kv_bytes.py " + " ".join(sys.argv[1:]), "before_commit": args.before,
            "batch": args.batch, "prompt": args.prompt, "after": run_tree(args), "before": run_before(args)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
