"""Tokens per forward (TPF) with and without a grammar constraint (docs/design.md#constrained-decoding, issue 27).

Part 1, the real model (``--model``, default the converted SmolLM2-135M A2D model), chat prompts asking for a JSON
object, greedy, batch 1, each setting with no constraint and with a JSON-schema constraint:

* ``b32-quota``: block 32, the default steps (one unforced token per step; under a grammar the tokens it forces
  come free within the window);
* ``b32-t0.9``: block 32, threshold 0.9 (Fast-dLLM);
* ``spec-b8``: self-speculative decoding, draft block 8 (constrained: masked verifier rows, grammar-masked drafts);
* ``b1``: block 1 (AR decoding: one token per forward either way).

Columns: TPF = generated tokens / NFE, NFE, tokens, wall seconds (shared machine: compare ratios), and the
fraction of outputs that parse as JSON and validate against the schema.

Part 2, skeleton infilling on a tiny random bidirectional model (``tests/tiny.py``; the real model is
prefix-causal, where fixed-position constraints are refused): the JSON skeleton's structural tokens fixed as
infilling ``constraints`` and value slots of fixed width left masked, against the grammar constraint on the same
model and schema: TPF and how often the output parses and validates.

    nice -n 10 .venv/bin/python benchmarks/bench_constrained.py --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import torch

import bench_common as bc
from unmask.engine import LLM, Constraint, SamplingParams

PROMPTS = [
    "Give me a JSON object describing a person, with name and age.",
    "Describe a city as JSON with its name and population.",
    "Return a JSON object for a book: its title and the year it was published.",
]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "value"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "value": {"type": "integer", "minimum": 0, "maximum": 100000000}}}
SETTINGS = {
    "b32-quota": dict(block_size=32, speculative=False),
    "b32-t0.9": dict(block_size=32, threshold=0.9, speculative=False),
    "spec-b8": dict(block_size=8, speculative=True),
    "b1": dict(block_size=1, speculative=False),
}


def valid(text: str, schema: dict | None) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    if schema is None:
        return isinstance(obj, dict)
    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError:
        return False
    return True


def run_setting(llm, prompts_ids, params_kw, constraint, max_tokens):
    toks = nfe = ok = 0
    secs = 0.0
    texts = []
    for ids in prompts_ids:
        p = SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint, **params_kw)
        t0 = time.perf_counter()
        out = llm.generate([ids], p)[0].outputs[0]
        secs += time.perf_counter() - t0
        toks += len(out.token_ids)
        nfe += out.nfe
        ok += valid(out.text, SCHEMA if constraint is not None else None)
        texts.append(out.text)
    return {"tokens": toks, "nfe": nfe, "tpf": toks / max(nfe, 1), "seconds": secs,
            "valid": ok / len(prompts_ids), "texts": texts}


def skeleton(tok, name_width: int, value_width: int):
    """The fixed tokens ``{generated position: id}`` of ``{"name": "<slot>", "value": <slot>}`` and its length."""
    pieces = [('{"name": "', None), (None, name_width), ('", "value": ', None), (None, value_width), ("}", None)]
    fixed, pos = {}, 0
    for text, width in pieces:
        if text is None:
            pos += width
            continue
        for t in tok.encode(text, add_special_tokens=False):
            fixed[pos] = t
            pos += 1
    return fixed, pos


def skeleton_part(seeds: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import loaded

    llm = LLM(loaded(attention="bidirectional", block_size=32))
    tiny_schema = {"type": "object", "additionalProperties": False, "required": ["name", "value"],
                   "properties": {"name": {"type": "string", "maxLength": 6},
                                  "value": {"type": "integer", "minimum": 0, "maximum": 999}}}
    fixed, length = skeleton(llm.model.tokenizer, 6, 3)
    rows = {}
    for label, kw in [("skeleton infilling", dict(constraints=fixed, max_tokens=length, ignore_eos=True)),
                      ("grammar (json_schema)", dict(constraint=Constraint("json_schema", tiny_schema),
                                                     max_tokens=48)),
                      ("grammar, threshold 0.5", dict(constraint=Constraint("json_schema", tiny_schema),
                                                      max_tokens=48, threshold=0.5))]:
        toks = nfe = ok = 0
        examples = []
        for seed in range(seeds):
            out = llm.generate("Hello", SamplingParams(temperature=1.0, seed=seed, **kw))[0].outputs[0]
            n = len(out.token_ids)
            # skeleton: every canvas position is generated, but only the slots cost denoising steps
            toks += n
            nfe += out.nfe
            ok += valid(out.text.strip(), tiny_schema)
            examples.append(out.text)
        rows[label] = {"tokens": toks, "nfe": nfe, "tpf": toks / max(nfe, 1), "valid": ok / seeds,
                       "examples": examples[:3]}
    return rows, {"fixed_positions": len(fixed), "length": length}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a servable checkpoint (default: the converted SmolLM2 A2D)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skeleton-seeds", type=int, default=20)
    args = bc.parse_args(ap, argv, threads=1)

    model = bc.real_model(args.model, block_size=1, weights=args.weights)
    llm = LLM(model, default_drafts="on")
    prompts_ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    compile_t0 = time.perf_counter()
    llm.generate([prompts_ids[0]], SamplingParams(max_tokens=1, constraint=Constraint("json_schema", SCHEMA)))
    first_compile = time.perf_counter() - compile_t0  # tokenizer bridge + grammar compile + one step

    results = {}
    for name, kw in SETTINGS.items():
        for label, c in (("none", None), ("json_schema", Constraint("json_schema", SCHEMA))):
            results[f"{name}/{label}"] = run_setting(llm, prompts_ids, kw, c, args.max_tokens)
            r = results[f"{name}/{label}"]
            print(f"{name:10s} {label:12s} tpf {r['tpf']:.2f} nfe {r['nfe']} valid {r['valid']:.2f} "
                  f"{r['seconds']:.1f}s", flush=True)
    skel, skel_info = skeleton_part(args.skeleton_seeds)

    rows = []
    for name in SETTINGS:
        a, b = results[f"{name}/none"], results[f"{name}/json_schema"]
        rows.append([name, a["tpf"], b["tpf"], b["tpf"] / a["tpf"], a["nfe"], b["nfe"], a["valid"], b["valid"],
                     a["seconds"], b["seconds"]])
    md = ("TPF with and without a JSON-schema constraint, real model, greedy, "
          f"{len(PROMPTS)} chat prompts, max_tokens {args.max_tokens} (valid = parses as JSON and, constrained, "
          "validates against the schema; unconstrained outputs are mostly prose or fenced JSON).\n\n")
    md += bc.markdown_table(["setting", "TPF none", "TPF schema", "ratio", "NFE none", "NFE schema", "valid none",
                             "valid schema", "s none", "s schema"], rows)
    md += (f"\n\nFirst constrained request (tokenizer bridge + compile + one step): {first_compile:.2f} s; later "
           "requests with the same schema reuse the compiled grammar.\n\n")
    md += (f"Skeleton infilling vs grammar on a tiny random bidirectional model ({args.skeleton_seeds} seeds, "
           f"temperature 1; skeleton: {skel_info['fixed_positions']} fixed structural tokens, "
           f"{skel_info['length'] - skel_info['fixed_positions']} masked value positions):\n\n")
    md += bc.markdown_table(["method", "TPF", "NFE", "tokens", "valid"],
                            [[k, v["tpf"], v["nfe"], v["tokens"], v["valid"]] for k, v in skel.items()])
    data = {"settings": {"max_tokens": args.max_tokens, "schema": SCHEMA, "prompts": PROMPTS,
                         "model": args.model or bc.DEFAULT_MODEL},
            "environment": bc.environment(args.threads), "results": results, "first_compile_s": first_compile,
            "skeleton": {"info": skel_info, "results": skel}}
    return bc.report("bench_constrained", data, md)


if __name__ == "__main__":
    raise SystemExit(main())
